#!/usr/bin/env python3
"""Where a decode step of the in-process engine goes, kernel by kernel (``torch.profiler``): random Llama-3-8B, fp16,
context 512, batch 1 and 64, with CUDA graphs and eager; the 18 longest kernels a step and the step's wall time.

    python3 benchmarks/profile_engine.py          (CUDA only; about a minute)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_engine  # noqa: E402
from kvpool_client.integrations.engine import DecodeEngine  # noqa: E402

CONTEXT, REPEATS = 512, 10


def profile_one(model, batch: int, graphs: bool) -> None:
    max_len = CONTEXT + 80
    num_blocks = batch * -(-max_len // 16) + 2 * batch + 8
    engine = DecodeEngine.in_process(model, num_blocks, 16, max_batch=batch, max_model_len=max_len,
                                     graph_sizes=[batch] if graphs else [])
    seqs = [engine.add_sequence() for _ in range(batch)]
    for i in range(0, batch, 16):
        engine.reserve(seqs[i:i + 16], CONTEXT)
    tokens = [1] * batch
    for _ in range(3):
        tokens = engine.decode(seqs, tokens).argmax(-1).tolist()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(REPEATS):
        tokens = engine.decode(seqs, tokens).argmax(-1).tolist()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / REPEATS * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            tokens = engine.decode(seqs, tokens).argmax(-1).tolist()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list] = {}
    for e in events:
        entry = by_name.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time / 3
    total = sum(t for _, t in by_name.values()) / 1e3
    print(f"\n=== batch {batch} context {CONTEXT} graphs {graphs}: wall {wall:.3f} ms a step, kernel time {total:.3f} "
          f"ms a step, {len(events) // 3} kernels a step")
    for name, (count, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:18]:
        print(f"  {t / 1e3:8.3f} ms  {count // 3:4d}x  {name}")
    engine.free(seqs)
    del engine
    torch.cuda.empty_cache()


def main() -> None:
    model = bench_engine.build_model(argparse.Namespace(tiny=False, quick=False, device="cuda", dtype="float16"))
    for batch in (1, 64):
        for graphs in (True, False):
            profile_one(model, batch, graphs)


if __name__ == "__main__":
    main()
