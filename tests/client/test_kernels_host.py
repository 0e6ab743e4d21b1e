"""The data path's calls on the host pool against the NumPy reference, the paged-attention reference against dense
attention, and the errors for wrong shapes, dtypes, slots and devices. No GPU needed."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.layout import KVLayout
from kvpool_client import InvalidArgumentError, KVPoolClient
from kvpool_client.kernels import reference

LAYOUT_ARGS = ("--num-layers", "3", "--num-kv-heads", "2", "--head-dim", "8", "--block-size", "4", "--dtype",
               "float16", "--pool-bytes", "64KiB", "--backend", "host")


@pytest.fixture(params=["block-major", "layer-major"])
def pool(server_factory, request):
    server = server_factory(*LAYOUT_ARGS, "--kv-layout", request.param)
    with KVPoolClient(server.address) as client, client.attach() as attached:
        yield attached


def test_whole_tokens_and_layers_round_trip_against_the_reference(pool):
    rng = np.random.default_rng(1)
    layout = pool.layout
    num_slots = pool.num_blocks * layout.block_size
    mirror = pool.blocks.copy()
    slots = rng.permutation(num_slots)[:37]
    data = rng.standard_normal((37, *layout.token_shape)).astype(np.float16)
    pool.write_slots(slots, data)
    reference.write_tokens(mirror, slots, data)
    assert np.array_equal(pool.blocks, mirror)
    assert np.array_equal(pool.read_slots(slots), data)
    out = np.empty_like(data)
    assert pool.read_slots(slots, out=out) is out and np.array_equal(out, data)
    for layer in range(layout.num_layers):
        s = rng.permutation(num_slots)[:5]
        k, v = (rng.standard_normal((5, 2, 8)).astype(np.float16) for _ in range(2))
        pool.write_layer(layer, s, k, v)
        reference.write_layer(mirror, layer, s, k, v)
        assert np.array_equal(pool.blocks, mirror)
        got_k, got_v = pool.read_layer(layer, s)
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)
    # a strided first dimension (a view of a fused K|V output) is fine
    fused = rng.standard_normal((4, 2, 2, 8)).astype(np.float16)
    pool.write_layer(0, [0, 1, 2, 3], fused[:, 0], fused[:, 1])
    assert np.array_equal(pool.read_layer(0, [0, 1, 2, 3])[1], fused[:, 1])


def test_layer_major_server_is_described_and_mapped_layer_major(pool):
    layout = pool.layout
    k, v = pool.layer_kv(1)
    if layout.kv_layout == "block-major":
        assert k.strides[0] == layout.block_bytes
        return
    # [L, 2, num_blocks, block_size, H, D] in memory: each layer's K and V is one contiguous tensor, back to back
    assert k.flags.c_contiguous and v.flags.c_contiguous
    base = pool.blocks.__array_interface__["data"][0]
    seg = pool.num_blocks * layout.segment_bytes
    assert k.__array_interface__["data"][0] == base + 2 * seg and v.__array_interface__["data"][0] == base + 3 * seg


@pytest.mark.parametrize("kv_layout", ["block-major", "layer-major"])
def test_write_kv_and_read_kv_rpcs_land_where_the_layout_says(server_factory, kv_layout):
    """The server's WriteKV/ReadKV and the attached mapping agree, in both orders: bytes written over gRPC show up in
    the client's (logical) blocks view at the sequence's slots, and bytes written through the mapping come back."""
    rng = np.random.default_rng(7)
    server = server_factory(*LAYOUT_ARGS, "--kv-layout", kv_layout)
    with KVPoolClient(server.address) as client, client.attach() as pool:
        layout = pool.layout
        assert layout.kv_layout == kv_layout and client.describe_pool().layout == layout
        seq = client.register()
        slots = np.asarray(client.append([seq], 11).slot_mapping, dtype=np.int64)
        data = rng.standard_normal((11, *layout.token_shape)).astype(np.float16)
        assert client.write_kv(seq, 0, data) == 11
        assert np.array_equal(reference.read_tokens(pool.blocks, slots), data)
        assert np.array_equal(pool.read_slots(slots), data)
        k = rng.standard_normal((11, 2, 8)).astype(np.float16)
        pool.write_layer(2, slots, k, k[::-1].copy())
        back = client.read_kv(seq, 0, 11)
        assert np.array_equal(back[:, 2, 0], k) and np.array_equal(back[:, 2, 1], k[::-1])
        assert np.array_equal(back[:, :2], data[:, :2])


def test_bad_arguments_give_clear_errors(pool):
    good = np.zeros((2, 3, 2, 2, 8), np.float16)
    limit = pool.num_blocks * pool.layout.block_size
    with pytest.raises(InvalidArgumentError, match="slots must lie"):
        pool.write_slots([0, limit], good)
    with pytest.raises(InvalidArgumentError, match="shape"):
        pool.write_slots([0], good)
    with pytest.raises(InvalidArgumentError, match="float16"):
        pool.write_slots([0, 1], good.astype(np.float32))
    with pytest.raises(InvalidArgumentError, match="integers"):
        pool.write_slots(np.array([0.0, 1.0]), good)
    kv = np.zeros((1, 2, 8), np.float16)
    with pytest.raises(InvalidArgumentError, match="layer 3"):
        pool.write_layer(3, [0], kv, kv)
    with pytest.raises(InvalidArgumentError, match="shape"):
        pool.write_layer(0, [0], kv[:, :1], kv)
    with pytest.raises(InvalidArgumentError, match="slots must lie"):
        pool.read_layer(0, [-1])

    class FakeDeviceArray:  # anything with __cuda_array_interface__ is a device array
        __cuda_array_interface__ = {"shape": (1,), "typestr": "<i8", "data": (0, False), "version": 3}

    with pytest.raises(InvalidArgumentError, match="host memory"):
        pool.write_layer(0, FakeDeviceArray(), kv, kv)


def test_bfloat16_pool_takes_uint16_bit_patterns(server_factory):
    args = [a if a != "float16" else "bfloat16" for a in LAYOUT_ARGS]
    server = server_factory(*args)
    with KVPoolClient(server.address) as client, client.attach() as pool:
        values = np.random.default_rng(2).standard_normal((3, 2, 8)).astype(np.float32)
        bits = reference.to_bfloat16_bits(values)
        pool.write_layer(1, [5, 9, 2], bits, bits)
        k, _ = pool.read_layer(1, [5, 9, 2])
        np.testing.assert_allclose(reference.as_float(k, "bfloat16"), values, rtol=1e-2)
        with pytest.raises(InvalidArgumentError):
            pool.write_layer(1, [5, 9, 2], values.astype(np.float16), bits)


@pytest.mark.parametrize("block_size,group", [(16, 4), (5, 1), (1, 8)])
def test_paged_decode_reference_equals_dense_attention(block_size, group):
    rng = np.random.default_rng(block_size)
    hkv, d, num_blocks = 2, 16, 64
    k_cache = rng.standard_normal((num_blocks, block_size, hkv, d))
    v_cache = rng.standard_normal((num_blocks, block_size, hkv, d))
    seq_lens = np.array([1, 17, 40])
    max_blocks = -(-seq_lens.max() // block_size)
    tables = np.stack([rng.permutation(num_blocks)[:max_blocks] for _ in seq_lens])
    q = rng.standard_normal((3, hkv * group, d))
    out = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.3, dtype="float64")
    for b, n in enumerate(seq_lens):
        # dense K, V of the sequence built token by token, without the reference's gather helper
        k = np.stack([k_cache[tables[b][t // block_size], t % block_size] for t in range(n)])
        v = np.stack([v_cache[tables[b][t // block_size], t % block_size] for t in range(n)])
        logits = np.einsum("hd,thd->ht", q[b], np.repeat(k, group, axis=1)) * 0.3
        w = np.exp(logits - logits.max(1, keepdims=True))
        w /= w.sum(1, keepdims=True)
        np.testing.assert_allclose(out[b], np.einsum("ht,thd->hd", w, np.repeat(v, group, axis=1)), atol=1e-12)


def test_causal_dense_reference_matches_its_prefix_rows():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((5, 4, 8)), rng.standard_normal((9, 2, 8)), rng.standard_normal((9, 2, 8))
    full = reference.dense_attention(q, k, v, 0.5, causal=True)
    # query i (position 4 + i) sees keys 0..4+i: the same as non-causal attention over that prefix
    for i in range(5):
        np.testing.assert_allclose(full[i], reference.dense_attention(q[i : i + 1], k[: 5 + i], v[: 5 + i], 0.5)[0])


def test_layout_token_shape_matches_what_the_references_move():
    layout = KVLayout(2, 3, 4, 5, "float32")
    blocks = np.zeros(layout.block_shape(3), np.float32)
    data = np.arange(2 * layout.token_elems, dtype=np.float32).reshape(2, *layout.token_shape)
    reference.write_tokens(blocks, [14, 0], data)
    assert np.array_equal(blocks[2, :, :, 4], data[0]) and np.array_equal(blocks[0, :, :, 0], data[1])


def test_loadgen_kv_source_device_on_a_host_pool_is_a_clear_error(server_factory):
    from kvpool_client.loadgen.worker import Worker, WorkerConfig

    server = server_factory(*LAYOUT_ARGS)
    with pytest.raises(RuntimeError, match="--kv-source host"):
        Worker(WorkerConfig(0, server.address, 1, 1, kv_source="device"), None, None)
    worker = Worker(WorkerConfig(0, server.address, 1, 1), None, None)  # auto: host arrays on a host pool
    assert not worker.device_kv
    worker.pool.close()
    worker.client.close()
