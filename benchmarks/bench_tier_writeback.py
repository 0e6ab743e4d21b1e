#!/usr/bin/env python3
"""The host tier's write-back, one step at a time: the CPU each part costs, without the other threads' noise.

    python benchmarks/bench_tier_writeback.py            host backend (any machine)
    python benchmarks/bench_tier_writeback.py --backend gpu

``bench_tier.py --sections append`` measures what the decode step pays with the write-back thread running beside
it; its p99 is the few slowest of a few hundred steps, and on a small shared machine those are the scheduler's
(GIL hand-offs of 5 ms). Here one thread plays every part in turn, round after round: a decode step (AppendToken
of ``--decode-seqs`` sequences, one token each), a churned prompt (RegisterSequence with its token ids, its
prefill, one decode token, Free: the pool evicts all the time), and ``--steps`` write-back steps
(``TierCopies.writeback_step``, what the write-back thread loops on). Each part's CPU (``time.thread_time``) is
recorded, and of each lock hold: the write-back step's hold (settle the completed chunks, plan the next), the
step's whole CPU (the hold, the chunk's events and its copy), its CPU up to its copy's start (``TierPool._start``:
the stretch a serving call that waited for the lock then waits for the GIL, the copy's calls being the first to
release it), and the decode step's own hold, with the tier and without it. p50 / p99 of each, over ``--rounds``
rounds.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "common"), str(ROOT / "client")]

import numpy as np  # noqa: E402

from kvpool.layout import KVLayout  # noqa: E402
from kvpool_server.config import ServerConfig  # noqa: E402
from kvpool_server.service.build import build_service  # noqa: E402
from kvpool_server.service.scope import CallScope  # noqa: E402

from bench_tier import LLAMA, SMALL, churn_prompt  # noqa: E402  (this directory)



class CpuTimedLock:
    """The guard's lock, instrumented: each hold's CPU (``time.thread_time``), under the name ``part`` names."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock, self.part, self.t0 = lock, "", 0.0
        self.holds: dict[str, list[float]] = {}

    def __enter__(self) -> CpuTimedLock:
        self.lock.acquire()
        self.t0 = time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.holds.setdefault(self.part, []).append(time.thread_time() - self.t0)
        self.lock.release()


def run(layout: KVLayout, backend: str, with_tier: bool, args: argparse.Namespace) -> dict[str, list[float]]:
    bs, pb = layout.block_size, args.prompt_blocks
    decode_blocks = args.decode_seqs * (args.rounds // bs + 2)
    config = ServerConfig(backend=backend, num_blocks=decode_blocks + 16 * pb, num_layers=layout.num_layers,
                          num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, block_size=bs,
                          dtype=layout.dtype, kv_layout=layout.kv_layout,
                          max_seq_len=args.rounds + 4 * bs + pb * bs,
                          host_tier_bytes=64 * pb * layout.block_bytes if with_tier else 0,
                          max_message_bytes=256 << 20)
    svc, admission = build_service(config)
    scope = CallScope(admission, None, None)
    lock = CpuTimedLock(svc.guard.lock)
    svc.guard.lock = lock  # type: ignore[assignment]
    tier = svc.tier
    if tier is not None:
        assert tier.memory.wait_ready(600)
        tier.stop()  # this thread runs its steps (offload on eviction stays off, as with the thread)
    cpu: dict[str, list[float]] = {"write-back step": [], "decode step": []}
    to_copy: list[float] = []  # when this write-back step's copy started (TierPool._start)
    stretch: list[float] = []  # each write-back step's CPU up to its copy's start
    if tier is not None:
        start_copy = tier.memory._start

        def timed_start(pairs: np.ndarray) -> object:
            to_copy.append(time.thread_time())
            return start_copy(pairs)

        tier.memory._start = timed_start  # type: ignore[method-assign]
    try:
        ids = []
        for _ in range(args.decode_seqs):
            with scope.call("RegisterSequence") as call:
                ids.append(svc.register(call).seq_id)
        for n in range(args.rounds):
            lock.part, t0 = "decode step", time.thread_time()
            with scope.call("AppendToken") as call:
                svc.append(call, ids, [1])
            cpu["decode step"].append(time.thread_time() - t0)
            lock.part = "churn"
            churn_prompt(svc, scope, n, pb * bs + 1)
            for _ in range(args.steps if tier is not None else 0):
                lock.part, t0 = "write-back step", time.thread_time()
                to_copy.clear()
                moved = tier.writeback_step(lock, config.host_tier_writeback_blocks)  # type: ignore[union-attr]
                if moved:
                    cpu["write-back step"].append(time.thread_time() - t0)
                if to_copy:
                    stretch.append(to_copy[0] - t0)
        if tier is not None:
            t = tier.tier
            print(f"  blocks written back {t.num_written_back}, overtaken {t.num_torn}, not kept {t.num_unkept}")
    finally:
        svc.guard.pool.close()
    return {**{f"{k} (whole)": v for k, v in cpu.items()}, "write-back step (to its copy)": stretch,
            **{f"{k} (lock hold)": v for k, v in lock.holds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="host", choices=("host", "gpu"))
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=4, help="write-back steps a round (a prompt: 32 blocks)")
    parser.add_argument("--prompt-blocks", type=int, default=32)
    parser.add_argument("--decode-seqs", type=int, default=64)
    args = parser.parse_args()
    layout = LLAMA if args.backend == "gpu" else SMALL
    for with_tier in (False, True):
        print(f"\n[{'with' if with_tier else 'without'} the tier] {args.rounds} rounds, {args.backend} pool, CPU us")
        for name, values in run(layout, args.backend, with_tier, args).items():
            if values and name != "churn (lock hold)":
                v = np.array(values) * 1e6
                print(f"  {name:<29} n {len(v):>5}   p50 {np.percentile(v, 50):7.1f}   p99 {np.percentile(v, 99):7.1f}"
                      f"   mean {v.mean():7.1f}")


if __name__ == "__main__":
    main()
