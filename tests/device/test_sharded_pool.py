"""ShardedPool (device/sharded_pool.py): N pools split by KV heads behind one block-id space, on the host backend
and, where there is a GPU, as N shards on one device (each shard its own memory and stream; a batch's copies or
clearing one launch for all of them: shard_groups.py, gpu_shard_group.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kvpool.layout import KVLayout
from kvpool.tensor_parallel import check_split, group_block_bytes, rank_heads, shard_layout
from kvpool_server.device import create_pool
from kvpool_server.device.pool import KVPool
from kvpool_server.device.protocol import Pool
from kvpool_server.device.shard_groups import ShardGroup, device_groups
from kvpool_server.device.sharded_pool import ShardedPool

from .devtest_util import BACKENDS, as_bytes, fill_random, random_tokens, to_host

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, dtype="float16")
LAYER_MAJOR = dataclasses.replace(LAYOUT, kv_layout="layer-major")
NUM_BLOCKS = 32
SHARDS = [2, 4, 8]  # 8 > 4 heads: one head a rank, each held by two ranks
GPU_ONLY = [b for b in BACKENDS if not isinstance(b, str)]


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit (random bit patterns may be NaNs)."""
    return a.shape == b.shape and np.array_equal(as_bytes(a), as_bytes(b))


def full_pool_tokens(pool: KVPool) -> np.ndarray:
    """Every slot's KV, read through the pool (joined across shards)."""
    return pool.read_slots(np.arange(pool.num_blocks * pool.layout.block_size))


def shard_tokens(pool: ShardedPool, rank: int) -> np.ndarray:
    """Every slot of rank ``rank``'s own memory, [slots, L, 2, heads of the rank, D], read from its blocks view."""
    blocks = to_host(pool.shard(rank).blocks)  # [num_blocks, L, 2, block_size, h, D]
    return blocks.transpose(0, 3, 1, 2, 4, 5).reshape(-1, *pool.shard(rank).layout.token_shape)


def test_heads_split_evenly_or_replicate_one_a_rank() -> None:
    assert [rank_heads(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert shard_layout(LAYOUT, 8).num_kv_heads == 1
    assert group_block_bytes(LAYOUT, 2) == LAYOUT.block_bytes
    assert group_block_bytes(LAYOUT, 8) == 2 * LAYOUT.block_bytes
    for heads, n in ((6, 4), (3, 2), (4, 65), (4, 0)):
        with pytest.raises(ValueError):
            check_split(heads, n)
    with pytest.raises(ValueError, match="rank"):
        rank_heads(4, 2, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", [LAYOUT, LAYER_MAJOR], ids=["block-major", "layer-major"])
@pytest.mark.parametrize("n", SHARDS)
def test_write_read_round_trip_equals_one_pool(backend: str, layout: KVLayout, n: int) -> None:
    rng = np.random.default_rng(n)
    slots = rng.permutation(NUM_BLOCKS * layout.block_size)[:50]
    data = random_tokens(layout, len(slots), rng)
    with create_pool(layout, backend=backend, num_blocks=NUM_BLOCKS) as one, \
            create_pool(layout, backend=backend, num_blocks=NUM_BLOCKS, tensor_parallel=n) as sharded:
        assert isinstance(sharded, ShardedPool) and isinstance(sharded, Pool) and sharded.tensor_parallel == n
        assert not isinstance(one, ShardedPool) and one.tensor_parallel == 1
        for pool in (one, sharded):
            # A new pool holds what its allocation held (zeros in fresh shared memory; after cudaMalloc anything:
            # an earlier pool's bytes, NaNs): blocks are cleared when they are handed out, as here, not at creation.
            pool.zero_blocks(np.arange(NUM_BLOCKS))
            pool.write_slots(slots, data)
        assert same(sharded.read_slots(slots), data)
        assert same(full_pool_tokens(sharded), full_pool_tokens(one))  # the written slots and nothing else
        for rank in range(n):  # each rank's own memory holds its heads of every token (both replicas when N > H)
            heads = sharded.rank_shards()[rank].heads
            assert same(shard_tokens(sharded, rank), full_pool_tokens(one)[:, :, :, heads.start:heads.stop])
            assert same(shard_tokens(sharded, rank)[slots], data[:, :, :, heads.start:heads.stop])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", [LAYOUT, LAYER_MAJOR], ids=["block-major", "layer-major"])
@pytest.mark.parametrize("n", SHARDS)
def test_copies_and_clearing_reach_every_shard(backend: str, layout: KVLayout, n: int) -> None:
    rng = np.random.default_rng(7)
    all_slots = np.arange(NUM_BLOCKS * layout.block_size)
    data = random_tokens(layout, len(all_slots), rng)
    with create_pool(layout, backend=backend, num_blocks=NUM_BLOCKS) as one, \
            create_pool(layout, backend=backend, num_blocks=NUM_BLOCKS, tensor_parallel=n) as sharded:
        for pool in (one, sharded):
            pool.write_slots(all_slots, data)
            assert pool.copy_blocks(np.array([[0, 10], [1, 11], [5, 12]])) == 3
            pool.zero_blocks(np.array([3, 20, 21, 7]))
        after = full_pool_tokens(one)
        assert not as_bytes(after[3 * layout.block_size:4 * layout.block_size]).any()
        assert same(after[10 * layout.block_size:11 * layout.block_size], data[:layout.block_size])
        assert same(full_pool_tokens(sharded), after)
        for rank in range(n):
            heads = sharded.rank_shards()[rank].heads
            assert same(shard_tokens(sharded, rank), after[:, :, :, heads.start:heads.stop])


@pytest.mark.parametrize("n", [2, 4])
def test_a_bad_batch_changes_no_shard(n: int) -> None:
    rng = np.random.default_rng(3)
    slots = np.arange(NUM_BLOCKS * LAYOUT.block_size)
    with create_pool(LAYOUT, backend="host", num_blocks=NUM_BLOCKS, tensor_parallel=n) as pool:
        pool.write_slots(slots, random_tokens(LAYOUT, len(slots), rng))
        before = full_pool_tokens(pool)
        for bad in ([[0, 1], [2, 1]], [[0, 1], [1, 2]], [[0, NUM_BLOCKS]]):
            with pytest.raises(ValueError):
                pool.copy_blocks(np.array(bad))
        with pytest.raises(ValueError):
            pool.zero_blocks(np.array([NUM_BLOCKS]))
        with pytest.raises(ValueError, match="shape"):
            pool.write_slots(slots[:2], np.zeros((2, *shard_layout(LAYOUT, n).token_shape), LAYOUT.storage_dtype))
        assert same(full_pool_tokens(pool), before)


def test_each_rank_has_its_own_segment_and_close_releases_all() -> None:
    with create_pool(LAYOUT, backend="host", num_blocks=NUM_BLOCKS, tensor_parallel=4) as pool:
        shards = pool.rank_shards()
        assert [s.rank for s in shards] == [0, 1, 2, 3]
        names = {s.attach.shm_name for s in shards}
        assert len(names) == 4 and pool.attach_info() == shards[0].attach  # rank 0 for clients that know no ranks
        assert all(s.layout == shard_layout(LAYOUT, 4) and s.attach.pool_bytes == NUM_BLOCKS * s.layout.block_bytes
                   for s in shards)
        assert pool.pool_bytes == NUM_BLOCKS * LAYOUT.block_bytes
        with pytest.raises(TypeError, match="shard"):
            pool.layer_kv(0)
    assert pool.closed and all(shard.closed for shard in pool.shards)
    with pytest.raises(RuntimeError):
        pool.copy_blocks([[0, 1]])


def test_sizes_count_every_rank() -> None:
    """pool_bytes is all ranks together: split heads give the blocks one pool would have; replicated heads fewer."""
    with create_pool(LAYOUT, backend="host", pool_bytes=64 * LAYOUT.block_bytes, tensor_parallel=4) as pool:
        assert pool.num_blocks == 64
    with create_pool(LAYOUT, backend="host", pool_bytes=64 * LAYOUT.block_bytes, tensor_parallel=8) as pool:
        assert pool.num_blocks == 32 and pool.pool_bytes == 64 * LAYOUT.block_bytes
    with pytest.raises(ValueError, match="split"):
        create_pool(dataclasses.replace(LAYOUT, num_kv_heads=6), backend="host", num_blocks=4, tensor_parallel=4)
    with pytest.raises(ValueError, match="one device per rank"):
        create_pool(LAYOUT, backend="host", num_blocks=4, tensor_parallel=2, devices=[0])


@pytest.mark.parametrize("op", ["copy", "zero"])
def test_every_shard_is_started_before_any_is_waited_for(op: str) -> None:
    """The device work of one call overlaps across shards: every shard's copy (or clearing) is started before the
    pool waits for any, and the call returns only after it waited for all."""
    events: list[tuple[str, int]] = []
    with create_pool(LAYOUT, backend="host", num_blocks=NUM_BLOCKS, tensor_parallel=4) as pool:
        for rank, shard in enumerate(pool.shards):
            start = shard._start_copy if op == "copy" else shard._start_zero
            wait = shard._wait

            def started(arg: np.ndarray, rank: int = rank, start=start) -> None:
                events.append(("start", rank))
                start(arg)

            def waited(rank: int = rank, wait=wait) -> None:
                events.append(("wait", rank))
                wait()

            setattr(shard, "_start_copy" if op == "copy" else "_start_zero", started)
            shard._wait = waited  # type: ignore[method-assign]
        if op == "copy":
            pool.copy_blocks(np.array([[0, 1], [2, 3]]))
        else:
            pool.zero_blocks(np.array([4, 9]))
    assert events == [("start", r) for r in range(4)] + [("wait", r) for r in range(4)]


@pytest.mark.parametrize("backend", GPU_ONLY)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_gpu_shards_on_one_device_have_their_own_memory_and_stream(backend: str, n: int) -> None:
    from kvpool_server.device.gpu_shard_group import GpuShardGroup

    with create_pool(LAYOUT, backend=backend, num_blocks=NUM_BLOCKS, tensor_parallel=n, devices=[0] * n) as pool:
        shards: list = pool.shards
        assert {shard.device_id for shard in shards} == {0}
        assert len({shard._base_ptr for shard in shards}) == n and len({shard._stream.ptr for shard in shards}) == n
        infos = pool.rank_shards()
        assert len({info.attach.cuda_ipc_handle for info in infos}) == n
        assert all(info.attach.cuda_device == 0 for info in infos)
        # ... and one device: one group, whose batch is one launch for all n shards
        [group] = pool.groups
        assert isinstance(group, GpuShardGroup) and group.shards == shards and group.num_shards == n
        launches = count_launches(group)
        pool.copy_blocks(np.array([[0, 1], [2, 3]]))
        pool.zero_blocks(np.array([9, 4]))  # not one run: the kernel
        assert launches == [n, n]


def count_launches(group: Any) -> list[int]:
    """Record the shards (``num_shards``) of every launch of ``group``'s copy and zero kernels from now on."""
    launches: list[int] = []
    for kernel in (group.copier, group.zeroer):
        def counted(*args: Any, launch: Any = kernel.launch, **kwargs: Any) -> None:
            launches.append(kwargs.get("num_shards", 1))
            launch(*args, **kwargs)

        kernel.launch = counted
    return launches


def test_shards_are_grouped_by_device_in_rank_order() -> None:
    class OnDevice:
        def __init__(self, device_id: int) -> None:
            self.device_id = device_id

    assert device_groups([OnDevice(0), OnDevice(1), OnDevice(0), OnDevice(1)]) == [[0, 2], [1, 3]]  # type: ignore
    assert device_groups([OnDevice(2), OnDevice(2), OnDevice(0)]) == [[0, 1], [2]]  # type: ignore
    with create_pool(LAYOUT, backend="host", num_blocks=NUM_BLOCKS, tensor_parallel=4) as pool:
        [group] = pool.groups  # host segments are one group: each shard's NumPy copy, then each shard's wait
        assert type(group) is ShardGroup and group.shards == pool.shards
        pool.launch_per_shard()
        assert [g.shards for g in pool.groups] == [[shard] for shard in pool.shards]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", [LAYOUT, LAYER_MAJOR], ids=["block-major", "layer-major"])
@pytest.mark.parametrize("n", SHARDS)
def test_one_launch_a_device_leaves_the_bytes_of_one_launch_a_shard(backend: str, layout: KVLayout, n: int) -> None:
    """A decode-like sequence of batches -- copies, then blocks reused (a copy's destination among them) cleared --
    leaves every shard's memory as the per-shard launches do, bit for bit."""
    rng = np.random.default_rng(11)
    slots = np.arange(NUM_BLOCKS * layout.block_size)
    data = random_tokens(layout, len(slots), rng)
    with create_pool(layout, backend=backend, num_blocks=NUM_BLOCKS, tensor_parallel=n) as grouped, \
            create_pool(layout, backend=backend, num_blocks=NUM_BLOCKS, tensor_parallel=n) as per_shard:
        per_shard.launch_per_shard()
        assert len(per_shard.groups) == n
        for pool in (grouped, per_shard):
            pool.write_slots(slots, data)
            pool.copy_blocks(np.array([[0, 10], [1, 11], [5, 12], [31, 13]]))
            pool.zero_blocks(np.array([11, 3, 20]))  # 11: the copy's destination, freed and handed out again
            pool.copy_blocks(np.array([[12, 3], [13, 20]]))  # the cleared blocks reused at once
            pool.zero_blocks(np.array([24, 25, 26]))  # one run (memsets for few spans a device, else the kernel)
            pool.zero_blocks(np.tile(np.array([27, 28]), NUM_BLOCKS))  # longer than num_blocks: in pieces
        assert same(full_pool_tokens(grouped), full_pool_tokens(per_shard))
        for rank in range(n):
            assert same(shard_tokens(grouped, rank), shard_tokens(per_shard, rank))
        assert not as_bytes(full_pool_tokens(grouped)[11 * layout.block_size:12 * layout.block_size]).any()


@pytest.mark.parametrize("backend", GPU_ONLY)
@pytest.mark.parametrize("layout", [LAYOUT, LAYER_MAJOR], ids=["block-major", "layer-major"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_a_gpu_group_of_k_shards_copies_and_clears_as_each_shard_alone(backend: str, layout: KVLayout, k: int) -> None:
    """GpuShardGroup directly, k = 1, 2, 4, 8 pools on one device against k twins each driven on its own: the same
    bytes in every pool after copies and clearings (scattered ids, a run, more ids than blocks), and each batch
    one launch over all k (a run: memsets instead when a block's spans times k are at most MEMSET_SPANS_MAX)."""
    from kvpool_server.device.gpu_pool import MEMSET_SPANS_MAX, GpuPool
    from kvpool_server.device.gpu_shard_group import GpuShardGroup

    part = shard_layout(layout, k) if k > 1 else layout
    grouped = [GpuPool(part, NUM_BLOCKS) for _ in range(k)]
    alone = [GpuPool(part, NUM_BLOCKS) for _ in range(k)]
    group = GpuShardGroup(grouped)
    try:
        for rank in range(k):  # the same random bytes in a pool and its twin
            fill_random(grouped[rank], np.random.default_rng(rank))
            fill_random(alone[rank], np.random.default_rng(rank))
        launches = count_launches(group)
        run = np.array([24, 25, 26], dtype=np.int32)
        by_memset = group.zeroer.spans_per_block * k <= MEMSET_SPANS_MAX
        assert group.zeroes_by_memset(run) == by_memset
        batches = [("copy", [[0, 10], [1, 11], [5, 12], [31, 13]]), ("zero", [11, 3, 20, 7]),
                   ("copy", [[12, 3], [13, 20]]), ("zero", run), ("zero", np.tile([27, 28], NUM_BLOCKS // 2 + 4))]
        for op, ids in batches:
            arr = np.ascontiguousarray(ids, dtype=np.int32)
            if op == "copy":
                group.start_copy(arr)
            else:
                group.start_zero(arr)
            group.wait()
            for pool in alone:
                if op == "copy":
                    pool.copy_blocks(arr)
                else:
                    pool.zero_blocks(arr)
        for a, b in zip(grouped, alone):
            assert same(to_host(a.blocks), to_host(b.blocks))
            assert not as_bytes(to_host(a.blocks)[[11, 24, 25, 26, 27, 28]]).any()
        # copy, zero, copy, the run (no launch by memset), the long batch (2 pieces): each launch over all k
        assert launches == [k] * (3 + (0 if by_memset else 1) + 2)
    finally:
        group.close()
        for pool in grouped + alone:
            pool.close()


def test_a_batch_is_validated_once_whatever_n_is() -> None:
    """The control path does not grow with N: the group checks a batch once; no shard checks it again."""
    with create_pool(LAYOUT, backend="host", num_blocks=NUM_BLOCKS, tensor_parallel=8) as pool:
        for shard in pool.shards:
            def refuse(*args: object) -> None:
                raise AssertionError("a shard validated a batch the group had validated")

            shard._checked_copies = refuse  # type: ignore[method-assign]
            shard._checked_block_ids = refuse  # type: ignore[method-assign]
            shard._checked_slots = refuse  # type: ignore[method-assign]
        pool.copy_blocks(np.array([[0, 1]]))
        pool.zero_blocks(np.array([2]))
        pool.write_slots(np.array([0]), np.zeros((1, *LAYOUT.token_shape), LAYOUT.storage_dtype))
        assert not as_bytes(pool.read_slots(np.array([0]))).any()
