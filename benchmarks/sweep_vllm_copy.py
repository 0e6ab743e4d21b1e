"""The vLLM connector's block-copy kernel (``integrations/vllm/block_copy.py``) over its variants (tile bytes,
warps, blocks a program, the word the bytes move as, an evict-first hint on the loads; ``copy_config.CopyConfig``),
CUDA only: Llama-3-8B (32 layers, 8 KV heads, head 128, fp16, block 16) in vLLM's NHD layout, 256 blocks stored into a
pool tensor and loaded back, each configuration's bytes checked against the PyTorch path; times of the whole
``BlockCopier.copy`` call (its ids uploaded through the stages, one launch) against ``copy_`` of the same
bytes in the same run, mean of 20. Prints a line per configuration (GB/s and the ratio to ``copy_`` of each
direction), ``BEST`` (the slowest direction's time the least), and the ``DEFAULT = CopyConfig(...)`` line to set in block_copy.py. 48 configurations, about a minute.

    PYTHONPATH=server:common:client python3 benchmarks/sweep_vllm_copy.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm_gpu  # noqa: E402

bench_vllm_gpu.stub_vllm()  # vLLM is not installed where the GPU is
import torch  # noqa: E402

from kvpool_client.integrations.vllm import block_copy  # noqa: E402
from kvpool_client.integrations.vllm.worker import kv_views  # noqa: E402

LAYERS, HEADS, HEAD, BLOCK, VLLM_BLOCKS, POOL_BLOCKS, COPIED = 32, 8, 128, 16, 300, 280, 256


def mean_ms(fn: Callable[[], object], n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    raws = [torch.randn(VLLM_BLOCKS, BLOCK, HEADS, 2 * HEAD, device="cuda", dtype=torch.float16)
            for _ in range(LAYERS)]  # NHD: memory [blocks, block_size, heads, 2 x head]
    layers = [kv_views(raw.permute(0, 2, 1, 3), BLOCK) for raw in raws]
    pool = torch.zeros(POOL_BLOCKS, LAYERS, 2, BLOCK, HEADS, HEAD, device="cuda", dtype=torch.float16)
    g = torch.Generator().manual_seed(0)
    pool_ids = torch.randperm(POOL_BLOCKS, generator=g)[:COPIED].tolist()
    vllm_ids = torch.randperm(VLLM_BLOCKS, generator=g)[:COPIED].tolist()
    src = torch.empty(COPIED * LAYERS * 2 * BLOCK * HEADS * HEAD, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    base = mean_ms(lambda: dst.copy_(src))
    gb = src.numel() * src.element_size() / 1e6  # per ms: GB/s
    print(f"copy_ of the same bytes {base:.3f} ms {gb / base:.0f} GB/s")
    expected = torch.zeros_like(pool)
    block_copy._torch_copy(layers, expected, pool_ids, vllm_ids, into_vllm=False)
    wrong, results = 0, []
    for cfg in configs():
        copier = block_copy.BlockCopier(layers, config=cfg)
        pool.zero_()
        copier.copy(pool, pool_ids, vllm_ids, into_vllm=False)
        ok = torch.equal(pool, expected) and copier.path == "triton"
        wrong += not ok
        store = mean_ms(lambda c=copier: c.copy(pool, pool_ids, vllm_ids, into_vllm=False))
        load = mean_ms(lambda c=copier: c.copy(pool, pool_ids, vllm_ids, into_vllm=True))
        worst = max(store, load)
        results.append((worst, cfg))
        print(f"{cfg.label()}  word used {copier.word}: store {store:.3f} ms {gb / store:6.0f} GB/s {base / store:.2f}x"
              f"  load {load:.3f} ms {gb / load:6.0f} GB/s {base / load:.2f}x  bytes {'ok' if ok else 'WRONG'}",
              flush=True)
    worst, best = min(results, key=lambda r: r[0])
    print(f"\nBEST (the slower direction {worst:.3f} ms, {base / worst:.2f}x of copy_ {base:.3f} ms): {best.label()}")
    print(f"set in block_copy.py: DEFAULT = {best!r}")
    return 1 if wrong else 0


def configs() -> list[block_copy.CopyConfig]:
    """The grid: tile bytes x warps x blocks a program x word x eviction hint."""
    return [block_copy.CopyConfig(tile_bytes=tile, num_warps=warps, blocks_per_program=bpp, word_bytes=word,
                                  evict_first=evict)
            for tile in (16384, 32768) for warps in (4, 8) for bpp in (1, 4, 16) for word in (2, 8)
            for evict in (False, True)]


if __name__ == "__main__":
    sys.exit(main())
