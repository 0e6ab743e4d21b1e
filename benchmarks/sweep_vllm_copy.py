"""The vLLM connector's block-copy kernel (``integrations/vllm/block_copy.py``) over its tile size and warps, CUDA
only: Llama-3-8B (32 layers, 8 KV heads, head 128, fp16, block 16) in vLLM's NHD layout, 256 blocks stored into a
pool tensor and loaded back, each configuration's bytes checked against the PyTorch path; times of the whole
``BlockCopier.copy`` call (ids uploaded, one launch) against ``copy_`` of the same bytes, mean of 20.

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
    print(f"copy_ of the same bytes {base:.3f} ms")
    expected = torch.zeros_like(pool)
    block_copy._torch_copy(layers, expected, pool_ids, vllm_ids, into_vllm=False)
    wrong = 0
    for tile in (2048, 4096, 8192, 16384):
        for warps in (2, 4, 8, 16):
            block_copy.TILE_ELEMENTS, block_copy.NUM_WARPS = tile, warps
            copier = block_copy.BlockCopier(layers)
            pool.zero_()
            copier.copy(pool, pool_ids, vllm_ids, into_vllm=False)
            ok = torch.equal(pool, expected) and copier.path == "triton"
            wrong += not ok
            store = mean_ms(lambda c=copier: c.copy(pool, pool_ids, vllm_ids, into_vllm=False))
            load = mean_ms(lambda c=copier: c.copy(pool, pool_ids, vllm_ids, into_vllm=True))
            print(f"tile {tile:6d} warps {warps:2d}: store {store:.3f} ms {base / store:.2f}x  load {load:.3f} ms "
                  f"{base / load:.2f}x  bytes {'ok' if ok else 'WRONG'}", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
