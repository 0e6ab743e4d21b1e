"""copy_blocks, write_slots/read_slots, layer_kv, validation and close, on every backend available."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from .devtest_util import BACKENDS, LAYOUTS, as_bytes, fill_random, ids, like, random_tokens, to_host

from kvpool.layout import KVLayout, gather_tokens, scatter_tokens
from kvpool_server.device import create_pool

def blocks_as_rows(flat: np.ndarray, layout: KVLayout) -> np.ndarray:
    return flat.reshape(-1, layout.block_bytes)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=ids)
def test_copy_blocks_matches_reference_on_random_data(backend: str, layout: KVLayout) -> None:
    rng = np.random.default_rng(1)
    num_blocks = 64
    with create_pool(layout, backend=backend, num_blocks=num_blocks) as pool:
        expected = blocks_as_rows(fill_random(pool, rng), layout).copy()
        for _ in range(5):
            c = int(rng.integers(1, num_blocks // 2 + 1))
            perm = rng.permutation(num_blocks)
            copies = np.stack([perm[:c], perm[c : 2 * c]], axis=1).astype(np.int32)
            assert pool.copy_blocks(copies) == c
            expected[copies[:, 1]] = expected[copies[:, 0]]
            got = blocks_as_rows(as_bytes(to_host(pool.blocks)), layout)
            assert np.array_equal(got, expected)  # the copied blocks, and every other block untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_empty_batch_is_a_no_op(backend: str) -> None:
    layout = LAYOUTS[1]
    with create_pool(layout, backend=backend, num_blocks=8) as pool:
        before = fill_random(pool, np.random.default_rng(2))
        assert pool.copy_blocks(np.zeros((0, 2), dtype=np.int32)) == 0
        assert pool.copy_blocks([]) == 0
        assert np.array_equal(as_bytes(to_host(pool.blocks)), before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "copies, message",
    [
        ([[0, 8]], "outside"),
        ([[-1, 2]], "outside"),
        ([[0, 2], [1, 2]], "distinct"),
        ([[0, 1], [1, 2]], "source"),
        ([[0, 1, 2]], "shape"),
        ([[0.0, 1.0]], "int"),
    ],
)
def test_copy_blocks_rejects_invalid_batches_and_changes_nothing(backend: str, copies: list, message: str) -> None:
    with create_pool(LAYOUTS[1], backend=backend, num_blocks=8) as pool:
        before = fill_random(pool, np.random.default_rng(3))
        with pytest.raises(ValueError, match=message):
            pool.copy_blocks(np.array(copies))
        assert np.array_equal(as_bytes(to_host(pool.blocks)), before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=ids)
def test_write_then_read_slots_roundtrip_and_lands_where_the_layout_says(backend: str, layout: KVLayout) -> None:
    rng = np.random.default_rng(4)
    num_blocks = 12
    with create_pool(layout, backend=backend, num_blocks=num_blocks) as pool:
        before = fill_random(pool, rng)
        slots = rng.permutation(pool.num_slots)[: max(1, pool.num_slots // 3)]
        data = random_tokens(layout, len(slots), rng)
        pool.write_slots(slots, data)

        assert np.array_equal(as_bytes(pool.read_slots(slots)), as_bytes(data))
        expected = before.view(layout.storage_dtype).reshape(layout.block_shape(num_blocks)).copy()
        scatter_tokens(expected, slots, layout.block_size, data)  # the layout's definition of where tokens go
        assert np.array_equal(as_bytes(to_host(pool.blocks)), as_bytes(expected))
        others = np.setdiff1d(np.arange(pool.num_slots), slots)[:7]
        assert np.array_equal(as_bytes(pool.read_slots(others)),
                              as_bytes(gather_tokens(expected, others, layout.block_size)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "slots, shape, dtype, message",
    [
        ([0, 1], (2, 2, 2, 2, 8), np.uint16, None),
        ([0, 1], (3, 2, 2, 2, 8), np.uint16, "shape"),
        ([0, 1], (2, 2, 2, 2, 8), np.float32, "dtype"),
        ([0, 8 * 16], (2, 2, 2, 2, 8), np.uint16, r"\[0, 128\)"),
        ([[0, 1]], (2, 2, 2, 2, 8), np.uint16, "1-d"),
    ],
)
def test_write_slots_validates_arguments(backend: str, slots: list, shape: tuple, dtype: type,
                                         message: str | None) -> None:
    with create_pool(LAYOUTS[1], backend=backend, num_blocks=8) as pool:
        data = np.ones(shape, dtype=dtype)
        if message is None:
            pool.write_slots(slots, data)
            assert np.array_equal(pool.read_slots(slots), data)
        else:
            with pytest.raises(ValueError, match=message):
                pool.write_slots(slots, data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_layout", ["block-major", "layer-major"])
def test_layer_kv_are_views_of_the_pool(backend: str, kv_layout: str) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", kv_layout=kv_layout)
    rng = np.random.default_rng(5)
    with create_pool(layout, backend=backend, num_blocks=6) as pool:
        fill_random(pool, rng)
        k, v = pool.layer_kv(1)
        assert k.shape == v.shape == (6, 4, 2, 8)
        assert k.strides[0] == layout.strides(6)[0] == (layout.segment_bytes if layout.layer_major
                                                         else layout.block_bytes)
        if layout.layer_major:  # one contiguous [num_blocks, block_size, H, D] tensor per layer and K/V
            assert k.flags.c_contiguous and v.flags.c_contiguous
        # pool -> view: a token written by write_slots shows through the views
        token = random_tokens(layout, 1, rng)
        pool.write_slots([4 * 3 + 2], token)  # block 3, offset 2
        assert np.array_equal(as_bytes(to_host(k[3, 2])), as_bytes(token[0, 1, 0]))
        assert np.array_equal(as_bytes(to_host(v[3, 2])), as_bytes(token[0, 1, 1]))
        # view -> pool: writing through the view changes what read_slots returns
        row = random_tokens(layout, 1, rng)[0, 0, 0]
        v[5, 0] = like(v, row)
        assert np.array_equal(as_bytes(pool.read_slots([5 * 4])[0, 1, 1]), as_bytes(row))
        with pytest.raises(IndexError):
            pool.layer_kv(3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_is_idempotent_and_stops_operations(backend: str) -> None:
    with create_pool(LAYOUTS[0], backend=backend, num_blocks=4) as pool:
        assert pool.backend == backend and not pool.closed
        assert pool.pool_bytes == 4 * LAYOUTS[0].block_bytes
    assert pool.closed
    pool.close()
    for call in (lambda: pool.copy_blocks([[0, 1]]), lambda: pool.read_slots([0]), pool.attach_info,
                 lambda: pool.write_slots([0], np.zeros((1, 1, 2, 1, 64), np.float32))):
        with pytest.raises(RuntimeError, match="closed"):
            call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_attach_info_describes_the_backend(backend: str) -> None:
    with create_pool(LAYOUTS[0], backend=backend, num_blocks=4) as pool:
        info = pool.attach_info()
        assert (info.backend, info.pool_bytes) == (backend, pool.pool_bytes)
        if backend == "host":
            assert info.shm_name and info.cuda_ipc_handle is None
        else:
            assert len(info.cuda_ipc_handle) == 64 and info.cuda_device == pool.device_id and info.shm_name is None


@pytest.fixture(scope="module")
def validation_pool():
    with create_pool(KVLayout(1, 1, 2, 1, "float16"), backend="host", num_blocks=10) as pool:
        yield pool


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=12))
def test_copy_batch_validation_agrees_with_a_set_based_reference(validation_pool, pairs: list) -> None:
    pool = validation_pool  # one pool across examples: stale scratch from earlier batches is exercised too
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    valid = len(set(dst)) == len(dst) and not set(src) & set(dst)
    if valid:
        assert np.array_equal(pool._checked_copies(np.array(pairs, dtype=np.int64).reshape(-1, 2)),
                              np.array(pairs, dtype=np.int32).reshape(-1, 2))
    else:
        with pytest.raises(ValueError):
            pool._checked_copies(np.array(pairs))
