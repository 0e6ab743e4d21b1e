"""zero_blocks: a block handed to a new owner reads as zeros (issue 20: freed KV must not reach the next owner).

Every backend available (the GPU cases skip without a GPU, unless KVPOOL_TEST_BACKEND=gpu), both layouts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvpool.layout import KVLayout
from kvpool_server.device import create_pool
from kvpool_server.device.host_pool import RUN_SLICES_MAX, block_runs
from kvpool_server.device.protocol import Pool

from .devtest_util import BACKENDS, LAYOUTS, as_bytes, fill_random, ids, needs_gpu, random_tokens, to_host

def block_rows(pool) -> np.ndarray:
    """The pool's bytes, one row per block in the order of the logical view (whatever the storage order)."""
    return as_bytes(to_host(pool.blocks)).reshape(pool.num_blocks, -1)


def zero_and_check(pool, block_ids, rng: np.random.Generator) -> None:
    """Random non-zero bytes everywhere, zero ``block_ids``: exactly those blocks read as zeros -- directly and
    through read_slots -- and every other byte is unchanged."""
    expected = fill_random(pool, rng).reshape(pool.num_blocks, -1).copy()
    pool.zero_blocks(block_ids)
    expected[np.asarray(block_ids, dtype=np.int64)] = 0
    assert np.array_equal(block_rows(pool), expected)
    named = np.unique(np.asarray(block_ids))
    assert not as_bytes(pool.read_slots(pool.block_slots(named))).any()
    others = np.setdiff1d(np.arange(pool.num_blocks), named)
    assert as_bytes(pool.read_slots(pool.block_slots(others))).all()  # fill_random wrote no zero byte


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=ids)
def test_zero_blocks_clears_exactly_the_named_blocks(backend: str, layout: KVLayout) -> None:
    rng = np.random.default_rng(1)
    with create_pool(layout, backend=backend, num_blocks=64) as pool:
        zero_and_check(pool, np.array([5], dtype=np.int32), rng)  # one block
        zero_and_check(pool, np.array([0, 1, 2, 3, 40, 63]), rng)  # runs at both ends of the pool
        zero_and_check(pool, rng.permutation(64)[:23], rng)  # scattered, unsorted
        zero_and_check(pool, np.arange(64), rng)  # all of it


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_layout", ["block-major", "layer-major"])
def test_zero_blocks_with_more_runs_than_slices_and_repeated_ids(backend: str, kv_layout: str) -> None:
    """Past RUN_SLICES_MAX runs the host zeroes by fancy indexing; repeats (even more ids than blocks) are harmless."""
    layout = dataclasses.replace(LAYOUTS[1], kv_layout=kv_layout)
    num_blocks = 4 * RUN_SLICES_MAX
    rng = np.random.default_rng(2)
    with create_pool(layout, backend=backend, num_blocks=num_blocks) as pool:
        scattered = np.arange(0, num_blocks, 2)  # 2 * RUN_SLICES_MAX runs of one block
        assert len(block_runs(scattered)[0]) > RUN_SLICES_MAX
        zero_and_check(pool, scattered, rng)
        zero_and_check(pool, np.array([7, 7, 3, 7, 3]), rng)
        zero_and_check(pool, np.concatenate([np.arange(num_blocks), np.arange(10)]), rng)


def test_block_runs() -> None:
    starts, ends = block_runs(np.array([9, 3, 4, 5, 5, 12, 10, 0], dtype=np.int32))
    assert starts.tolist() == [0, 3, 9, 12] and ends.tolist() == [1, 6, 11, 13]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_written_block_handed_to_a_new_owner_reads_as_zeros(backend: str) -> None:
    """The issue's case: owner A writes its KV into block 3; the block is freed and handed to B, which reads before
    writing. Without zero_blocks B reads A's bytes; with it, zeros -- and B's own writes then read back."""
    layout = LAYOUTS[2]
    rng = np.random.default_rng(3)
    with create_pool(layout, backend=backend, num_blocks=8) as pool:
        slots = pool.block_slots([3])
        secret = random_tokens(layout, len(slots), rng)
        pool.write_slots(slots, secret)
        assert np.array_equal(as_bytes(pool.read_slots(slots)), as_bytes(secret))  # A's KV, as B would see it
        pool.zero_blocks(np.array([3], dtype=np.int32))
        assert not as_bytes(pool.read_slots(slots)).any()
        mine = random_tokens(layout, 2, rng)
        pool.write_slots(slots[:2], mine)
        got = pool.read_slots(slots)
        assert np.array_equal(as_bytes(got[:2]), as_bytes(mine)) and not as_bytes(got[2:]).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("empty", [np.zeros(0, dtype=np.int32), [], np.zeros((0, 2), dtype=np.int64)])
def test_zero_blocks_of_an_empty_batch_does_nothing(backend: str, empty, monkeypatch: pytest.MonkeyPatch) -> None:
    with create_pool(LAYOUTS[1], backend=backend, num_blocks=8) as pool:
        before = fill_random(pool, np.random.default_rng(4))

        def no_work(ids: np.ndarray) -> None:
            raise AssertionError("an empty batch reached the backend")

        monkeypatch.setattr(pool, "_zero", no_work)
        assert pool.zero_blocks(empty) is None
        assert np.array_equal(as_bytes(to_host(pool.blocks)), before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "block_ids, message",
    [([8], "outside"), ([-1], "outside"), ([0, 3, 9], "outside"), ([[0, 1]], "1-d"), ([0.0, 1.0], "int")],
)
def test_zero_blocks_rejects_invalid_ids_and_changes_nothing(backend: str, block_ids: list, message: str) -> None:
    with create_pool(LAYOUTS[1], backend=backend, num_blocks=8) as pool:
        before = fill_random(pool, np.random.default_rng(5))
        with pytest.raises(ValueError, match=message):
            pool.zero_blocks(block_ids)
        with pytest.raises(ValueError, match=message):
            pool.block_slots(block_ids)
        assert np.array_equal(as_bytes(to_host(pool.blocks)), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_blocks_after_close_raises(backend: str) -> None:
    pool = create_pool(LAYOUTS[1], backend=backend, num_blocks=4)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.zero_blocks([0])
    with pytest.raises(RuntimeError, match="closed"):
        pool.zero_blocks([])


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_slots_are_every_slot_of_each_block_in_order(backend: str) -> None:
    layout = LAYOUTS[5]  # block_size 5
    with create_pool(layout, backend=backend, num_blocks=8) as pool:
        assert pool.block_slots([2, 0]).tolist() == [10, 11, 12, 13, 14, 0, 1, 2, 3, 4]
        assert pool.block_slots([]).dtype == np.int64 and len(pool.block_slots([])) == 0
        assert isinstance(pool, Pool)


@pytest.mark.parametrize("kv_layout", ["block-major", "layer-major"])
def test_a_process_mapping_the_host_pool_sees_the_zeros(kv_layout: str) -> None:
    from kvpool_client.mapping import map_host_pool  # here: kvpool_client imports grpc, absent on the GPU image

    layout = dataclasses.replace(LAYOUTS[1], kv_layout=kv_layout)
    with create_pool(layout, backend="host", num_blocks=16) as pool:
        fill_random(pool, np.random.default_rng(6))
        info = pool.attach_info()
        with map_host_pool(info.shm_name, info.pool_bytes) as mapped:
            pool.zero_blocks([4, 5, 11])
            rows = as_bytes(mapped.blocks(layout)).reshape(16, -1)
            assert not rows[[4, 5, 11]].any() and rows[[0, 3, 6, 10, 12, 15]].all()


@needs_gpu
def test_gpu_zero_blocks_is_one_launch_or_one_memset_a_span_and_allocates_nothing() -> None:
    import cupy

    from kvpool_server.device.gpu_pool import GpuPool

    rng = np.random.default_rng(7)
    with GpuPool(LAYOUTS[1], 512) as pool:
        fill_random(pool, rng)
        launches = []
        launch = pool.zeroer.launch
        pool.zeroer.launch = lambda *args: (launches.append(args[2]), launch(*args))  # type: ignore[method-assign]
        batch, run = rng.permutation(512)[:300], np.arange(100, 140)
        assert not pool.zeroes_by_memset(batch) and pool.zeroes_by_memset(run)
        assert pool.zeroes_by_memset(np.array([7])) and not pool.zeroes_by_memset(np.array([7, 7]))
        pool.zero_blocks(batch)  # warm-up
        pool.zero_blocks(run)
        mempool = cupy.get_default_memory_pool()
        used, total, free = mempool.used_bytes(), mempool.total_bytes(), cupy.cuda.runtime.memGetInfo()[0]
        for _ in range(3):
            pool.zero_blocks(batch)
            pool.zero_blocks(run)
            pool.zero_blocks(np.zeros(0, dtype=np.int32))
        assert launches == [300] * 4  # the run went by memset, the empty batch nowhere
        assert (mempool.used_bytes(), mempool.total_bytes()) == (used, total)
        assert free - cupy.cuda.runtime.memGetInfo()[0] < (1 << 20)


@needs_gpu
@pytest.mark.parametrize("kv_layout", ["block-major", "layer-major"])
def test_gpu_zero_blocks_beyond_4_gib_with_llama_sized_blocks(kv_layout: str) -> None:
    """A 6 GiB pool of 2 MiB blocks (Llama-3-8B): blocks past 2**31 and 2**32 bytes are zeroed, others kept --
    by the kernel (scattered ids; layer-major also one run) and by memset (one run, block-major)."""
    import cupy

    from kvpool_server.device.gpu_pool import GpuPool

    layout = KVLayout(32, 8, 128, 16, "float16", kv_layout)
    with GpuPool(layout, 3072) as pool:
        pool.blocks[...] = 1  # every element non-zero
        cupy.cuda.Device().synchronize()  # the fill ran on CuPy's stream, which the pool's does not wait for
        zeroed = np.array([0, 1023, 1024, 2047, 2048, 3071, 2500, 2501, 2502])
        pool.zero_blocks(zeroed[:6])
        pool.zero_blocks(zeroed[6:])
        per_block = pool.blocks[0].size
        assert int(cupy.count_nonzero(pool.blocks)) == (3072 - len(zeroed)) * per_block
        for block in zeroed.tolist():
            assert int(cupy.count_nonzero(pool.blocks[block])) == 0, block
        for block in (1, 1022, 1025, 2046, 2049, 2499, 2503, 3070):
            assert int(cupy.count_nonzero(pool.blocks[block])) == per_block, block
