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


def run_size(args: argparse.Namespace, num_blocks: int, tmp: Path) -> dict[str, Any]:
    server_args = ["--backend", "host", "--log-level", "WARNING", "--block-size", str(args.block_size),
                   "--head-dim", str(args.head_dim), "--num-blocks", str(num_blocks)]
    out = tmp / f"pool-{num_blocks}.json"
    with Server(*server_args) as server:
        cmd = _script("kvpool-loadgen", "kvpool_client.loadgen.main") + [
            "--target", server.target, "--workload", "shared-prefix", "--num-prompts", str(args.num_prompts),
            "--shared-tokens", str(args.shared_tokens), "--unique-tokens", str(args.unique_tokens),
            "--processes", str(args.processes), "--concurrency", str(args.concurrency),
            "--completions", str(args.completions), "--max-len", str(args.max_len), "--seed", str(args.seed),
            "--verify", "table", "--no-progress", "--json", str(out),
        ]
        rc = subprocess.call(cmd, stdout=subprocess.DEVNULL)
    row: dict[str, Any] = {"pool_blocks": num_blocks, "rc": rc}
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


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: str) -> None:
    import matplotlib  # noqa: PLC0415  (the loadgen extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    done = [r for r in rows if r["rc"] == 0]
    failed = [r for r in rows if r["rc"] != 0]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([r["pool_blocks"] for r in done], [100 * r["token_hit_rate"] for r in done], "o-", label="token hit rate")
    if failed:  # too small: the run did not complete (its requests waited for blocks), or one request did not fit
        ax.plot([r["pool_blocks"] for r in failed], [100 * r.get("token_hit_rate", 0.0) for r in failed], "x",
                color="tab:red", markersize=9, label="run did not complete (pool too small)")
    ceiling = 100 * args.shared_tokens / (args.shared_tokens + args.unique_tokens)
    ax.axhline(ceiling, color="gray", linestyle="--", label=f"ceiling {ceiling:.1f}% (shared / prompt)")
    prompts_blocks = args.num_prompts * (args.shared_tokens // args.block_size)
    ax.axvline(prompts_blocks, color="tab:red", linestyle=":", label=f"the shared prompts' blocks ({prompts_blocks})")
    ax.set_xlabel("pool size (blocks)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"shared-prefix: {args.num_prompts} x {args.shared_tokens} shared + {args.unique_tokens} unique "
                 f"tokens, {args.processes} processes, {args.concurrency} in flight, {args.completions} requests",
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
    p.add_argument("--json", metavar="PATH", default="out/exp/prefix_sweep.json")
    p.add_argument("--plot", metavar="PATH", default="out/exp/prefix_sweep.png")
    args = p.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_size(args, int(n), Path(tmp)) for n in args.pool_blocks.split(",")]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))
    plot(rows, args, args.plot)
    print("\n| pool blocks | token hit rate | requests that hit | blocks evicted | KV errors | rc |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{100 * r['token_hit_rate']:.2f}%" if "token_hit_rate" in r else "-"
        print(f"| {r['pool_blocks']} | {rate} | {r.get('requests_with_hit', '-')} | {r.get('blocks_evicted', '-')} "
              f"| {r.get('verify_errors', '-')} | {r['rc']} |")
    print(f"\nprefix sweep: {len(rows)} pool sizes in {time.monotonic() - started:.0f} s; {args.json}, {args.plot}")
    return 1 if any(r.get("verify_errors", 0) or r["rc"] not in (0, 2) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
