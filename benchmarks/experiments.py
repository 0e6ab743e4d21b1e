"""The experiments of docs/experiments.md, against real kvpool-server processes (host backend).

  capacity  In one fixed pool, how many sequences run at once: admission by free blocks with paging, against
            naive preallocation (every admitted request reserves max_len tokens) and an oracle reservation
            (each request reserves exactly its final length: a contiguous allocator that knows the future).
            A single scheduler process runs decode steps (one AppendToken for every running sequence); a new
            request is admitted when the pool can hold its prompt (paged) or its reservation (naive, oracle).
            Paged runs out of blocks when running sequences grow: it then preempts the most recently admitted
            request (frees it, recomputes it later: vLLM's recompute preemption). No KV is written: capacity is
            block accounting.
  sharing   Blocks saved by sharing, from kvpool-loadgen runs: beam search of width 2, 4, 6 and parallel
            sampling of 2, 4, 6 samples, on the Alpaca-like and ShareGPT-like length distributions.

    .venv/bin/python benchmarks/experiments.py capacity [--requests 2000] [--pool-blocks 4096]
    .venv/bin/python benchmarks/experiments.py sharing [--completions 48]

`make experiments` (2,000 requests, 400 completions) takes about 35 minutes on a 2-core machine;
`make experiments-quick` (200 requests, 24 completions) about 3 and shows the same shape, not the same numbers.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvpool_client import KVPoolClient, ResourceExhaustedError
from kvpool_client.loadgen.workload import distribution, make_request


def _script(name: str, module: str) -> list[str]:
    path = Path(sys.executable).with_name(name)
    return [str(path)] if path.exists() else [sys.executable, "-m", module]


class Server:
    """A kvpool-server on a unix socket in a temp dir; a context manager that SIGTERMs it."""

    def __init__(self, *args: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvp-exp-", dir="/tmp")
        self.target = f"unix:{self.dir}/s.sock"
        self.log = open(f"{self.dir}/server.log", "wb")
        cmd = _script("kvpool-server", "kvpool_server")
        cmd += ["--unix-socket", f"{self.dir}/s.sock", "--address", "", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Server:
        with KVPoolClient(self.target) as client:
            client.wait_until_serving(timeout=60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        self.log.close()


# ------------------------------------------------------------------------------------------------ capacity
@dataclass
class Job:
    index: int
    prompt_len: int
    output_len: int
    generated: int = 0
    seq_id: int | None = None

    @property
    def length(self) -> int:
        return self.prompt_len + self.generated

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


def run_capacity(target: str, policy: str, lengths: str, num_requests: int, seed: int) -> dict:
    """Serve ``num_requests`` requests FCFS under one admission policy; measure sequences running per step."""
    dist = distribution(lengths)
    with KVPoolClient(target, timeout=30) as client:
        stats = client.stats()
        num_blocks, bs = stats.num_blocks_total, stats.block_size
        blocks = lambda tokens: -(-tokens // bs)  # noqa: E731
        waiting = deque(
            Job(i, s.prompt_len, s.output_lens[0])
            for i, s in ((i, make_request(seed, i, dist, "plain")) for i in range(num_requests))
        )
        running: list[Job] = []
        used = 0  # blocks the server says we hold (exact: we are its only client)
        reserved = 0  # blocks reserved by the naive / oracle policies
        saturated_running, steps, preemptions, tokens, token_blocks, recomputed = [], 0, 0, 0, [], 0

        def reservation(job: Job) -> int:
            return blocks(dist.max_len) if policy == "naive" else blocks(job.final_len)

        def release(job: Job) -> None:
            nonlocal used, reserved
            used -= client.free(job.seq_id)
            reserved -= reservation(job) if policy != "paged" else 0
            job.seq_id = None

        start = time.perf_counter()
        while waiting or running:
            # Admission, first come first served.
            while waiting:
                job = waiting[0]
                if policy == "paged":
                    # watermark: one spare block per running sequence, for their next decode steps
                    fits = num_blocks - used >= blocks(job.length) + len(running) + 1
                else:
                    fits = num_blocks - reserved >= reservation(job)
                if not fits:
                    break
                waiting.popleft()
                job.seq_id = client.register()
                used += len(client.append(job.seq_id, job.length).new_block_ids)  # prefill (or recompute)
                reserved += reservation(job) if policy != "paged" else 0
                running.append(job)
            if waiting:
                saturated_running.append(len(running))
                token_blocks.append((sum(j.length for j in running), used if policy == "paged" else reserved))
            # One decode step for every running sequence; on a full pool preempt the newest and retry.
            while running:
                try:
                    result = client.append([j.seq_id for j in running], 1)
                    break
                except ResourceExhaustedError:
                    victim = running.pop()
                    recomputed += victim.length
                    release(victim)
                    waiting.appendleft(victim)  # recompute: prefill prompt + generated tokens when readmitted
                    preemptions += 1
            if not running:
                continue
            used += len(result.new_block_ids)
            steps += 1
            tokens += len(running)
            for job in running:
                job.generated += 1
            for job in [j for j in running if j.generated >= j.output_len]:
                release(job)
                running.remove(job)
        wall = time.perf_counter() - start
        final = client.stats()
        assert final.num_blocks_used == 0 and final.num_sequences == 0, final
        client.check_invariants()
    sat = np.array(saturated_running, dtype=np.float64)
    tb = np.array(token_blocks, dtype=np.float64).reshape(-1, 2)
    return {
        "policy": policy,
        "lengths": lengths,
        "max_len": dist.max_len,
        "pool_blocks": num_blocks,
        "requests": num_requests,
        "mean_final_len": float(np.mean([make_request(seed, i, dist, "plain").max_total_len
                                         for i in range(num_requests)])),
        "running_mean_saturated": float(sat.mean()) if sat.size else 0.0,
        "running_median_saturated": float(np.median(sat)) if sat.size else 0.0,
        "running_max": int(sat.max()) if sat.size else 0,
        "saturated_steps": int(sat.size),
        "kv_used_for_tokens_saturated": float(tb[:, 0].sum() / (tb[:, 1].sum() * bs)) if tb.size else 0.0,
        "decode_steps": steps,
        "tokens_per_step": tokens / steps if steps else 0.0,
        "preemptions": preemptions,
        "tokens_recomputed": recomputed,
        "wall_s": wall,
    }


def capacity(args: argparse.Namespace) -> list[dict]:
    rows = []
    pool_bytes = str(args.pool_blocks * 8192)  # the seed layout: 8 KiB a block
    for lengths in ("uniform", "sharegpt"):
        for policy in ("naive", "oracle", "paged"):
            with Server("--backend", "host", "--pool-bytes", pool_bytes, "--max-num-seqs", "8192",
                        "--max-batch", "8192", "--log-level", "WARNING") as server:
                row = run_capacity(server.target, policy, lengths, args.requests, args.seed)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| lengths | policy | running at once: mean | median | max | KV holding tokens | preemptions "
          "| tokens recomputed | decode tokens / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['lengths']} (max {r['max_len']}) | {r['policy']} | {r['running_mean_saturated']:.1f} | "
              f"{r['running_median_saturated']:.0f} | {r['running_max']} | "
              f"{100 * r['kv_used_for_tokens_saturated']:.1f}% | {r['preemptions']} | "
              f"{r['tokens_recomputed']} | {r['tokens_per_step']:.1f} |")
    return rows


# ------------------------------------------------------------------------------------------------ sharing
def sharing(args: argparse.Namespace) -> list[dict]:
    rows = []
    with Server("--backend", "host", "--log-level", "WARNING") as server, tempfile.TemporaryDirectory() as tmp:
        for lengths in ("alpaca", "sharegpt"):
            for mode, flag in (("beam", "--beam-width"), ("parallel", "--num-samples")):
                for width in (2, 4, 6):
                    out = Path(tmp) / f"{lengths}-{mode}-{width}.json"
                    cmd = _script("kvpool-loadgen", "kvpool_client.loadgen.main") + [
                        "--target", server.target, "--lengths", lengths, "--mode", mode, flag, str(width),
                        "--completions", str(args.completions), "--concurrency", str(args.concurrency),
                        "--seed", str(args.seed), "--verify", "table", "--no-progress", "--json", str(out),
                    ]
                    rc = subprocess.call(cmd, stdout=subprocess.DEVNULL)
                    s = json.loads(out.read_text())
                    row = {
                        "lengths": lengths, "mode": mode, "width": width, "rc": rc,
                        "saved_avg": s["sharing"]["blocks_saved_avg"],
                        "saved_peak": s["sharing"]["blocks_saved_at_peak"],
                        "copies": s["sharing"]["copies"], "forks": s["sharing"]["forks"],
                        "verify_errors": s["verification"]["errors"], "completions": s["run"]["completions"],
                        "end_blocks_used": s["end"]["blocks_used"],
                        "mean_prompt": s["workload"]["mean_prompt_len"],
                        "mean_output": s["workload"]["mean_output_len"],
                        "wall_s": s["run"]["wall_s"],
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print("\n| lengths | mode | width | blocks saved (time-avg) | at peak | CoW copies | verify errors |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['lengths']} | {r['mode']} | {r['width']} | {100 * r['saved_avg']:.1f}% | "
              f"{100 * r['saved_peak']:.1f}% | {r['copies']} | {r['verify_errors']} |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="experiment", required=True)
    c = sub.add_parser("capacity")
    c.add_argument("--requests", type=int, default=2000)
    c.add_argument("--pool-blocks", type=int, default=4096)
    c.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("sharing")
    s.add_argument("--completions", type=int, default=48)
    s.add_argument("--concurrency", type=int, default=8)
    s.add_argument("--seed", type=int, default=0)
    for q in (c, s):
        q.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    started = time.monotonic()
    rows = capacity(args) if args.experiment == "capacity" else sharing(args)
    print(f"\n{args.experiment}: {len(rows)} runs in {time.monotonic() - started:.0f} s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r.get("rc", 0) or r.get("verify_errors", 0) or r.get("end_blocks_used", 0)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
