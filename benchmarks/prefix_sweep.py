"""Token hit rate of the shared-prefix workload against the pool size (issue #13: "with a pool too small for
everything: hit rate against the pool size, as a plot").

For each --pool-blocks size a fresh kvpool-server (host backend, on a unix socket in a temp dir, as
benchmarks/experiments.py starts them) and one kvpool-loadgen --workload shared-prefix run against it; a row per
size in the JSON, and a PNG of the token hit rate against the pool size with the ceiling shared / (shared + unique)
and the blocks the shared prompts need marked.

    .venv/bin/python benchmarks/prefix_sweep.py --pool-blocks 600,1000,2000,4000 -n 64 \\
        --json out/exp/prefix_sweep.json --plot out/exp/prefix_sweep.png

A pool smaller than the requests in flight need makes them wait for blocks (RESOURCE_EXHAUSTED retries); one
smaller than a single request is refused by the load generator (exit 2, recorded as such).

``--host-tier-bytes N`` (issue 23, ``make experiments-tier``): each size is run twice, the pool alone ("rows", the
GPU-only curve) and with a host tier of N bytes ("tier_rows"; give one that holds every prompt); the plot gets a
second line. The reference is the largest size without the tier (give one large enough for everything): the JSON's
"summary" has each tier run's hit rate over it (the target: >= 0.95 where the prompts need >= 4x the pool) and the
server's own tier figures (restored blocks, evictions the write-back had not reached, ...).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments import Server, _script  # benchmarks/experiments.py, beside this file
from kvpool_client import KVPoolClient

TIER_FIGURES = ("num_blocks", "num_blocks_offloaded", "num_blocks_written_back", "num_blocks_restored",
                "num_blocks_torn", "num_blocks_dropped", "num_evictions_unkept", "num_blocks_fenced")


def run_size(args: argparse.Namespace, num_blocks: int, tmp: Path, tier: bool = False) -> dict[str, Any]:
    server_args = ["--backend", "host", "--log-level", "WARNING", "--block-size", str(args.block_size),
                   "--head-dim", str(args.head_dim), "--num-blocks", str(num_blocks)]
    if tier:
        server_args += ["--host-tier-bytes", args.host_tier_bytes]
    out = tmp / f"pool-{num_blocks}{'-tier' if tier else ''}.json"
    stats = None
    with Server(*server_args) as server:
        cmd = _script("kvpool-loadgen", "kvpool_client.loadgen.main") + [
            "--target", server.target, "--workload", "shared-prefix", "--num-prompts", str(args.num_prompts),
            "--shared-tokens", str(args.shared_tokens), "--unique-tokens", str(args.unique_tokens),
            "--processes", str(args.processes), "--concurrency", str(args.concurrency),
            "--completions", str(args.completions), "--max-len", str(args.max_len), "--seed", str(args.seed),
            "--verify", "table", "--no-progress", "--json", str(out),
        ]
        rc = subprocess.call(cmd, stdout=subprocess.DEVNULL)
        if tier:
            with KVPoolClient(server.target) as client:
                stats = client.stats()
    row: dict[str, Any] = {"pool_blocks": num_blocks, "host_tier": tier, "rc": rc}
    if stats is not None and stats.host_tier is not None:  # the server's own count, the load generator's aside
        row["prefix_host_hit_tokens"] = stats.prefix_host_hit_tokens
        row["tier"] = {k: getattr(stats.host_tier, k) for k in TIER_FIGURES}
    if out.exists():
        s = json.loads(out.read_text())
        prefix, events = s["prefix"], s.get("events", {})
        row.update(
            token_hit_rate=prefix["token_hit_rate"], cached_tokens=prefix["cached_tokens"],
            prompt_tokens=prefix["prompt_tokens"], requests_with_hit=prefix["requests_with_hit"],
            completions=s["run"]["completions"], verify_errors=s["verification"]["errors"],
            blocks_evicted=events.get("blocks_removed", 0), blocks_sealed=events.get("blocks_stored", 0),
            resource_exhausted_retries=s["run"]["resource_exhausted_retries"],
            peak_copies=max((r["peak_copies"] for r in prefix["resident_copies"].values()), default=0),
            wall_s=s["run"]["wall_s"],
        )
    print(json.dumps(row), flush=True)
    return row


def summary(rows: list[dict[str, Any]], tier_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The tier runs against the reference: the largest pool without the tier."""
    ref = max(rows, key=lambda r: r["pool_blocks"])
    base = ref.get("token_hit_rate", 0.0)
    return {
        "reference_pool_blocks": ref["pool_blocks"], "reference_token_hit_rate": base,
        "tier_over_reference": {str(r["pool_blocks"]): (r["token_hit_rate"] / base if base else None)
                                for r in tier_rows if "token_hit_rate" in r},
        "gpu_only_over_reference": {str(r["pool_blocks"]): (r["token_hit_rate"] / base if base else None)
                                    for r in rows if "token_hit_rate" in r},
    }


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: str,
         tier_rows: list[dict[str, Any]] | None = None) -> None:
    import matplotlib  # noqa: PLC0415  (the loadgen extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    tier_rows = tier_rows or []
    done = [r for r in rows if r["rc"] == 0]
    failed = [r for r in rows if r["rc"] != 0]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    label = "pool only (GPU-only)" if tier_rows else "token hit rate"
    ax.plot([r["pool_blocks"] for r in done], [100 * r["token_hit_rate"] for r in done], "o-", label=label)
    tier_done = [r for r in tier_rows if r["rc"] == 0]
    if tier_rows:
        ax.plot([r["pool_blocks"] for r in tier_done], [100 * r["token_hit_rate"] for r in tier_done], "s-",
                color="tab:green", label=f"with host tier ({args.host_tier_bytes})")
        failed += [r for r in tier_rows if r["rc"] != 0]
    if failed:  # too small: the run did not complete (its requests waited for blocks), or one request did not fit
        ax.plot([r["pool_blocks"] for r in failed], [100 * r.get("token_hit_rate", 0.0) for r in failed], "x",
                color="tab:red", markersize=9, label="run did not complete (pool too small)")
    ceiling = 100 * args.shared_tokens / (args.shared_tokens + args.unique_tokens)
    ax.axhline(ceiling, color="gray", linestyle="--", label=f"ceiling {ceiling:.1f}% (shared / prompt)")
    prompts_blocks = args.num_prompts * (args.shared_tokens // args.block_size)
    ax.axvline(prompts_blocks, color="tab:red", linestyle=":", label=f"the shared prompts' blocks ({prompts_blocks})")
    if tier_rows:
        ax.axvline(prompts_blocks / 4, color="tab:purple", linestyle=":",
                   label=f"the prompts need 4x the pool ({prompts_blocks // 4})")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["pool_blocks"] for r in rows], [str(r["pool_blocks"]) for r in rows])
    ax.set_xlabel("pool size (blocks)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"shared-prefix: {args.num_prompts} x {args.shared_tokens} shared + {args.unique_tokens} unique "
                 f"tokens, {args.processes} processes, {args.concurrency} in flight, {args.completions} requests"
                 + (f"\nhost tier {args.host_tier_bytes}, a fresh server per run (host backend)" if tier_rows else ""),
                 fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool-blocks", default="600,1000,2000,4000", help="comma-separated pool sizes in blocks")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--shared-tokens", type=int, default=8000)
    p.add_argument("--unique-tokens", type=int, default=1000)
    p.add_argument("--processes", "-p", type=int, default=4)
    p.add_argument("--concurrency", "-c", type=int, default=8)
    p.add_argument("--completions", "-n", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256, help="output lengths: uniform up to this (default 256)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=1, help="server layout: tiny tokens keep big pools cheap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-tier-bytes", default="", metavar="N",
                   help="also run each size with this host tier (e.g. 4MiB): the tier line beside the pool's")
    p.add_argument("--json", metavar="PATH", default="out/exp/prefix_sweep.json")
    p.add_argument("--plot", metavar="PATH", default="out/exp/prefix_sweep.png")
    args = p.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        rows, tier_rows = [], []
        for n in args.pool_blocks.split(","):
            rows.append(run_size(args, int(n), Path(tmp)))
            if args.host_tier_bytes:
                tier_rows.append(run_size(args, int(n), Path(tmp), tier=True))
    result: dict[str, Any] = {"config": vars(args), "rows": rows}
    if args.host_tier_bytes:
        result.update(tier_rows=tier_rows, summary=summary(rows, tier_rows))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    plot(rows, args, args.plot, tier_rows)
    print_table(rows, tier_rows)
    if args.host_tier_bytes:
        s = result["summary"]
        print(f"\nreference: {s['reference_pool_blocks']} blocks without the tier, "
              f"{100 * s['reference_token_hit_rate']:.2f}%; with the tier / reference: "
              + ", ".join(f"{k}: {v:.3f}" for k, v in s["tier_over_reference"].items() if v is not None))
    print(f"\nprefix sweep: {len(rows)} pool sizes in {time.monotonic() - started:.0f} s; {args.json}, {args.plot}")
    return 1 if any(r.get("verify_errors", 0) or r["rc"] not in (0, 2) for r in rows + tier_rows) else 0


def print_table(rows: list[dict[str, Any]], tier_rows: list[dict[str, Any]]) -> None:
    print("\n| pool blocks | host tier | token hit rate | requests that hit | blocks evicted | restored from the tier "
          "| evictions not kept | KV errors | rc |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows + tier_rows, key=lambda r: (r["pool_blocks"], r["host_tier"])):
        rate = f"{100 * r['token_hit_rate']:.2f}%" if "token_hit_rate" in r else "-"
        tier = r.get("tier", {})
        print(f"| {r['pool_blocks']} | {'yes' if r['host_tier'] else 'no'} | {rate} | {r.get('requests_with_hit', '-')} "
              f"| {r.get('blocks_evicted', '-')} | {tier.get('num_blocks_restored', '-')} "
              f"| {tier.get('num_evictions_unkept', '-')} | {r.get('verify_errors', '-')} | {r['rc']} |")


if __name__ == "__main__":
    sys.exit(main())
