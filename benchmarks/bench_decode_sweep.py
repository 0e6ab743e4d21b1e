#!/usr/bin/env python3
"""Configurations of the Triton paged decode kernel (``kernels/paged_attention.py``: BLOCK_N, warps, stages, context
splits) timed inside a CUDA graph (20 calls a replay, so launch costs do not hide the kernel), on the decode engine's
block-major Llama-3-8B layer view (8 KV heads, 32 query heads, head_dim 128, 16-token blocks, random block tables),
at batch 1 / 16 / 64 / 256 and context 512 / 2,048. Prints the default's time and the five best per shape.

    python3 benchmarks/bench_decode_sweep.py          (CUDA only; about a minute)
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "client")]

import torch  # noqa: E402

from kvpool_client.kernels.paged_attention import paged_decode_attention  # noqa: E402

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 32, 8, 32, 128, 16
SHAPES = [(1, 512), (16, 512), (64, 512), (256, 512), (64, 2048), (256, 2048)]
CONFIGS = list(itertools.product((32, 64, 128), (4, 8), (2, 3), (1, 2, 4, 8)))  # block_n, warps, stages, splits


def timed(fn, calls: int = 20) -> float:
    """Microseconds a call, ``calls`` calls captured in one graph, 5 replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()), torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 5 / calls * 1e3


def sweep(batch: int, context: int) -> None:
    width = -(-(context + 80) // BLOCK)
    num_blocks = batch * width + 8
    full = torch.empty(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float16, device="cuda")
    full[:, 0].normal_()  # layer 0's K and V; the block stride is the whole block's (32 layers)
    k, v = full[:, 0, 0], full[:, 0, 1]
    tables = torch.randperm(num_blocks - 8, device="cuda")[:batch * width].view(batch, width).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=torch.float16, device="cuda")
    out = torch.empty_like(q)
    ref = paged_decode_attention(q, k, v, tables, lens).float()
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2
    default = timed(functools.partial(paged_decode_attention, q, k, v, tables, lens, out=out))
    rows = []
    for block_n, warps, stages, splits in CONFIGS:
        call = functools.partial(paged_decode_attention, q, k, v, tables, lens, out=out, num_splits=splits,
                                 block_n=block_n, num_warps=warps, num_stages=stages)
        err = float((call().float() - ref).abs().max())
        rows.append((timed(call), block_n, warps, stages, splits, err))
    rows.sort()
    print(f"\nbatch {batch} context {context}: default {default:.1f} us = {kv_bytes / default / 1e3:.0f} GB/s", flush=True)
    for t, block_n, warps, stages, splits, err in rows[:5]:
        print(f"   {t:7.1f} us {kv_bytes / t / 1e3:6.0f} GB/s  block_n {block_n:3d} warps {warps} stages {stages} "
              f"splits {splits}  max |diff| {err:.1e}")
    del full, k, v
    torch.cuda.empty_cache()


def main() -> None:
    torch.manual_seed(0)
    for batch, context in SHAPES:
        sweep(batch, context)


if __name__ == "__main__":
    main()
