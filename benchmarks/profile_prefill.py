#!/usr/bin/env python3
"""Where a prefill of the in-process engine goes, kernel by kernel (``torch.profiler``): random Llama-3-8B, fp16,
a 4,096-token prefix cached + 256 computed (the TTFT hit of bench_ttft.py) and all 4,352 computed (its recompute);
the wall time, the kernels' time and the 15 longest kernels of each.

    python3 benchmarks/profile_prefill.py          (CUDA only; about a minute)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_engine  # noqa: E402
from kvpool_client.integrations.engine import DecodeEngine  # noqa: E402
from kvpool_client.integrations.layer_helpers import NAMES  # noqa: E402

PREFIX, SUFFIX = 4096, 256


def prefill_once(engine: DecodeEngine, prompt: list[int], key: bytes) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    seq, cached = engine.add_prompt(prompt, key)
    int(engine.prefill([seq], [prompt[cached:]])[0].argmax())
    wall = time.perf_counter() - t0
    engine.free([seq])
    return wall * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--helpers", default=None, choices=NAMES, help="the elementwise helpers (the engine's default)")
    helpers = p.parse_args().helpers
    args = argparse.Namespace(device="cuda", dtype="float16", tiny=False, quick=False)
    torch.manual_seed(0)
    model = bench_engine.build_model(args)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, model.config.vocab_size, PREFIX).tolist()
    suffixes = [rng.integers(0, model.config.vocab_size, SUFFIX).tolist() for _ in range(8)]
    engine = DecodeEngine.in_process(model, 4096, 16, max_batch=1, max_model_len=PREFIX + SUFFIX + 32,
                                     graph_sizes=[1], helpers=helpers)
    print(f"elementwise helpers: {engine.model.helpers}", flush=True)
    engine.generate([prefix + suffixes[0]], 2)
    for name, miss in (("hit (4,096 cached + 256)", False), ("recompute (4,352)", True)):
        def key(i: int, miss: bool = miss) -> bytes:  # a key nobody used: nothing cached
            return f"miss-{i}".encode() if miss else b""
        walls = [prefill_once(engine, prefix + suffixes[i], key(i)) for i in (1, 2, 3)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            prefill_once(engine, prefix + suffixes[4], key(4))
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        by_name: dict[str, list] = {}
        for e in events:
            entry = by_name.setdefault(e.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += e.device_time
        total = sum(t for _, t in by_name.values()) / 1e3
        print(f"\n=== {name}: wall {min(walls):.2f} ms (best of 3), kernel time {total:.2f} ms, {len(events)} kernels")
        for kname, (count, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]:
            print(f"  {t / 1e3:8.3f} ms  {count:5d}x  {kname}")
        cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
        print("  host (self CPU): " + ", ".join(f"{e.key[:40]} {e.self_cpu_time_total / 1e3:.1f} ms" for e in cpu))


if __name__ == "__main__":
    main()
