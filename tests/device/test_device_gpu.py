"""GPU-only properties: CUDA IPC from another process, no allocation after start-up, chunked staging, the copy
kernel and the variants scripts/gpu_device_check.py explores, memory freed on close. Skipped without a GPU
(mandatory with KVPOOL_TEST_BACKEND=gpu)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvpool.layout import KVLayout, gather_tokens

from .devtest_util import as_bytes, fill_random, needs_gpu, random_tokens, to_host

pytestmark = needs_gpu

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")  # 32 KiB blocks

CHILD = r"""
import hashlib, sys
import cupy, numpy as np
from kvpool_client.mapping import map_gpu_pool
handle, nbytes, device, offset, seed = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5])
pool = map_gpu_pool(handle, nbytes, device)
print(hashlib.sha256(pool.flat.get().tobytes()).hexdigest(), flush=True)
pool.flat[offset:offset + 4096] = cupy.asarray(np.random.default_rng(seed).integers(1, 256, 4096, dtype=np.uint8))
pool.close()
"""


def gpu_pool(num_blocks: int, **kwargs):
    from kvpool_server.device.gpu_pool import GpuPool

    return GpuPool(LAYOUT, num_blocks, **kwargs)


def test_another_process_maps_the_pool_by_cuda_ipc_and_sees_and_writes_the_same_bytes() -> None:
    import hashlib

    rng = np.random.default_rng(1)
    with gpu_pool(16) as pool:
        data = fill_random(pool, rng)
        info = pool.attach_info()
        offset = 3 * LAYOUT.block_bytes + 1024
        result = subprocess.run([sys.executable, "-c", CHILD, info.cuda_ipc_handle.hex(), str(info.pool_bytes),
                                 str(info.cuda_device), str(offset), "5"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == hashlib.sha256(data.tobytes()).hexdigest()
        written = np.random.default_rng(5).integers(1, 256, 4096, dtype=np.uint8)
        now = as_bytes(to_host(pool.blocks))
        assert np.array_equal(now[offset : offset + 4096], written)
        assert np.array_equal(now[:offset], data[:offset]) and np.array_equal(now[offset + 4096 :], data[offset + 4096 :])


def test_operations_allocate_no_device_memory_after_start_up() -> None:
    import cupy

    rng = np.random.default_rng(2)
    with gpu_pool(256, staging_bytes=8 * LAYOUT.token_bytes) as pool:
        fill_random(pool, rng)  # its upload may allocate in CuPy's pool: not an operation of the KV pool
        slots = rng.permutation(pool.num_slots)[:100]
        tokens = random_tokens(LAYOUT, 100, rng)
        perm = rng.permutation(256)
        copies = np.stack([perm[:100], perm[100:200]], axis=1)

        def run_all() -> None:
            pool.copy_blocks(copies)
            pool.write_slots(slots, tokens)
            pool.read_slots(slots)
            pool.attach_info()

        run_all()  # warm-up: lazy driver state, if any
        mempool = cupy.get_default_memory_pool()
        used, total, free = mempool.used_bytes(), mempool.total_bytes(), cupy.cuda.runtime.memGetInfo()[0]
        for _ in range(3):
            run_all()
        assert (mempool.used_bytes(), mempool.total_bytes()) == (used, total)
        assert free - cupy.cuda.runtime.memGetInfo()[0] < (1 << 20)


def test_requests_larger_than_staging_go_in_chunks() -> None:
    rng = np.random.default_rng(3)
    with gpu_pool(8, staging_bytes=3 * LAYOUT.token_bytes) as pool:
        assert pool.staging_tokens == 3
        before = fill_random(pool, rng)
        slots = rng.permutation(pool.num_slots)[:10]  # 3 + 3 + 3 + 1
        tokens = random_tokens(LAYOUT, 10, rng)
        pool.write_slots(slots, tokens)
        assert np.array_equal(as_bytes(pool.read_slots(slots)), as_bytes(tokens))
        expected = before.view(LAYOUT.storage_dtype).reshape(LAYOUT.block_shape(8)).copy()
        expected[slots // 16, :, :, slots % 16] = tokens
        assert np.array_equal(as_bytes(to_host(pool.blocks)), as_bytes(expected))
        assert np.array_equal(as_bytes(gather_tokens(to_host(pool.blocks), slots, 16)), as_bytes(tokens))


LAYOUTS = [LAYOUT, KVLayout(5, 2, 40, 16, "float32"), KVLayout(1, 1, 2, 1, "float16")]
LAYOUT_IDS = ["32KiB", "51200B", "8B"]  # 16-byte vectors; a partial last chunk; 4-byte vectors


def copy_and_check(pool, layout: KVLayout, rng: np.random.Generator) -> None:
    """copy_blocks of 40 random pairs among 96 blocks changes exactly the destinations, to their sources."""
    expected = fill_random(pool, rng).reshape(96, layout.block_bytes).copy()
    perm = rng.permutation(96)
    copies = np.stack([perm[:40], perm[40:80]], axis=1)
    pool.copy_blocks(copies)
    expected[copies[:, 1]] = expected[copies[:, 0]]
    assert np.array_equal(as_bytes(to_host(pool.blocks)).reshape(96, -1), expected)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_the_copy_kernel_copies_exactly_the_pairs(layout: KVLayout) -> None:
    from kvpool_server.device.gpu_pool import GpuPool

    with GpuPool(layout, 96) as pool:
        copy_and_check(pool, layout, np.random.default_rng(layout.block_bytes))


VARIANTS = [(512, 4, "plain", False), (256, 8, "plain", False), (256, 4, "plain", False), (1024, 4, "plain", False),
            (512, 4, "stream", False), (128, 8, "nc", False), (256, 16, "plain", False), (512, 4, "plain", True),
            (256, 8, "plain", True), (64, 1, "plain", True)]


@pytest.mark.parametrize("threads, unroll, cache, persistent", VARIANTS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_every_explored_copy_kernel_variant_copies_exactly_the_pairs(threads: int, unroll: int, cache: str,
                                                                     persistent: bool, layout: KVLayout) -> None:
    """The variants scripts/gpu_device_check.py times (scripts/copy_kernel_variants.py), in place of the pool's."""
    import importlib.util
    from pathlib import Path

    from kvpool_server.device.gpu_pool import GpuPool

    path = Path(__file__).resolve().parents[2] / "scripts" / "copy_kernel_variants.py"
    spec = importlib.util.spec_from_file_location("copy_kernel_variants", path)
    variants = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = variants  # its dataclass resolves string annotations through sys.modules
    spec.loader.exec_module(variants)
    with GpuPool(layout, 96) as pool:
        config = variants.CopyConfig(threads, unroll, cache, persistent)
        pool.copier = variants.VariantCopier(layout.block_bytes, config)
        if persistent:
            pool.copier.resident_ctas = 7  # a grid smaller than the work, so every CTA must loop
        copy_and_check(pool, layout, np.random.default_rng(threads + unroll))


def test_close_frees_the_allocation() -> None:
    import cupy

    nbytes = 1 << 30
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    pool = gpu_pool(nbytes // LAYOUT.block_bytes)
    assert free_before - cupy.cuda.runtime.memGetInfo()[0] >= nbytes
    pool.close()
    pool.close()
    assert free_before - cupy.cuda.runtime.memGetInfo()[0] < (16 << 20)  # all of it, scratch too


@needs_gpu
@pytest.mark.parametrize("kv_layout", ["block-major", "layer-major"])
def test_copy_kernel_with_llama_sized_blocks(kv_layout: str) -> None:
    """2 MiB blocks (Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, fp16, 16 tokens): 128 chunks per block-major
    block, or 64 spans of 32 KiB per layer-major block; every copied block equals its source, no other changes."""
    from kvpool_server.device.gpu_pool import GpuPool

    layout = KVLayout(32, 8, 128, 16, "float16", kv_layout)
    rng = np.random.default_rng(11)
    with GpuPool(layout, 48) as pool:
        before = fill_random(pool, rng).reshape(48, -1)
        perm = rng.permutation(48)
        pairs = np.stack([perm[:20], perm[20:40]], 1)
        assert pool.copy_blocks(pairs) == 20
        expected = before.copy()
        expected[pairs[:, 1]] = before[pairs[:, 0]]
        assert np.array_equal(as_bytes(to_host(pool.blocks)).reshape(48, -1), expected)


@needs_gpu
@pytest.mark.parametrize("kv_layout", ["block-major", "layer-major"])
def test_copy_kernel_beyond_4_gib(kv_layout: str) -> None:
    """A 6 GiB pool: pairs whose blocks (or, layer-major, spans) lie past 2**31 and 2**32 bytes copy exactly."""
    import cupy

    from kvpool_server.device.gpu_pool import GpuPool

    layout = KVLayout(32, 8, 128, 16, "float16", kv_layout)  # 2 MiB blocks
    num_blocks = 3072  # 6 GiB
    rng = np.random.default_rng(12)
    with GpuPool(layout, num_blocks) as pool:
        src = np.array([0, 1, 1500, 2047, 2100, 3000])
        dst = np.array([3071, 2049, 2, 2048, 10, 1024])  # no block is both a source and a destination
        data = {}
        for block in src.tolist():
            values = cupy.asarray(rng.integers(0, 2**16, pool.blocks[block].shape, dtype=np.uint16))
            pool.blocks[block] = values.view(pool.blocks.dtype)
            data[block] = cupy.asnumpy(values)
        # an untouched block keeps its bytes
        witness = cupy.asnumpy(pool.blocks[5].view(cupy.uint16)).copy()
        cupy.cuda.Device().synchronize()
        pool.copy_blocks(np.stack([src, dst], 1).astype(np.int32))
        for s, d in zip(src.tolist(), dst.tolist()):
            assert np.array_equal(cupy.asnumpy(pool.blocks[d].view(cupy.uint16)), data[s]), (s, d)
        assert np.array_equal(cupy.asnumpy(pool.blocks[5].view(cupy.uint16)), witness)
