"""A server with --tensor-parallel N (host backend: N shared-memory pools split by KV heads): DescribePool says the
split, attach(rank=r) maps rank r's shard, WriteKV/ReadKV keep the whole-token format, copy-on-write and clearing
reach every rank -- all as with one pool."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvpool_client import InvalidArgumentError, KVPoolClient
from kvpool_client.rank_group import RankGroup
from kvpool_client.loadgen.pattern import kv_pattern, token_keys

BS = 16
HEADS = 4
# 2 layers, 4 KV heads of 8 float32: 512 bytes a token, 8 KiB a block (the seed's sizes), 128 blocks
LAYOUT_ARGS = ("--backend", "host", "--num-blocks", "128", "--num-layers", "2", "--num-kv-heads", str(HEADS),
               "--head-dim", "8", "--block-size", str(BS))


def tp_server(server_factory, n: int, backend: str = "host"):
    return server_factory(*LAYOUT_ARGS, "--tensor-parallel", str(n), "--backend", backend)


def _has_gpu() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001  (no CuPy, no driver: no GPU)
        return False


# The GPU: N shards on one device (each its own allocation, stream and CUDA IPC handle), mapped by CUDA IPC.
BACKENDS = ["host", pytest.param("gpu", marks=pytest.mark.skipif(not _has_gpu(), reason="no GPU"))]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_describe_pool_says_the_split(server_factory, n):
    server = tp_server(server_factory, n)
    with KVPoolClient(server.address) as client:
        desc = client.describe_pool()
        assert desc.tensor_parallel == n and len(desc.shards) == n
        assert desc.layout.num_kv_heads == HEADS and desc.token_bytes == 512  # the full layout: the wire format
        per = max(1, HEADS // n)
        assert [s.heads for s in desc.shards] == [range(r * HEADS // n, r * HEADS // n + per) for r in range(n)]
        assert all(s.rank == r and s.layout.num_kv_heads == per for r, s in enumerate(desc.shards))
        assert len({s.shm_name for s in desc.shards}) == n
        assert (desc.shm_name, desc.pool_bytes) == (desc.shards[0].shm_name, desc.shards[0].pool_bytes)  # rank 0
        assert desc.shards[0].pool_bytes == 128 * desc.shards[0].layout.block_bytes


def test_one_pool_is_one_rank_with_every_head(server_factory):
    server = server_factory(*LAYOUT_ARGS)
    with KVPoolClient(server.address) as client:
        desc = client.describe_pool()
        assert desc.tensor_parallel == 1 and [s.heads for s in desc.shards] == [range(HEADS)]
        assert desc.for_rank(0) == desc and client.attach(rank=0).layout == desc.layout
        assert not isinstance(client.attach_ranks(), RankGroup)


@pytest.mark.parametrize("n", [2, 4])
def test_writekv_readkv_and_each_ranks_view(server_factory, n):
    one, sharded = server_factory(*LAYOUT_ARGS), tp_server(server_factory, n)
    results = []
    for server in (one, sharded):
        with KVPoolClient(server.address) as client:
            seq = client.register()
            client.append(seq, 37)
            kv = kv_pattern(token_keys(seq % 1000, 0, 37), client.describe_pool().layout)
            client.write_kv(seq, 0, kv)
            back = client.read_kv(seq)
            assert np.array_equal(back, kv)
            if server is sharded:
                slots = client.block_table(seq).slots()
                for rank, shard in enumerate(client.describe_pool().shards):
                    view = client.attach(rank=rank)
                    assert view.layout == shard.layout
                    assert np.array_equal(view.read_slots(slots), kv[:, :, :, shard.heads.start:shard.heads.stop])
            results.append(back.tobytes())
    assert results[0] != b"" and len(results[0]) == len(results[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 4, 8])  # 8 ranks, 4 heads: each head on two ranks
def test_ranks_write_their_heads_and_readkv_joins_them(server_factory, n, backend):
    server = tp_server(server_factory, n, backend)
    with KVPoolClient(server.address) as client:
        seq = client.register()
        result = client.append(seq, 20)
        layout = client.describe_pool().layout
        kv = kv_pattern(token_keys(5, 0, 20), layout)
        # Each rank attached once (CUDA maps a handle once a process): attach_ranks() is attach(rank=r) for every r.
        group = client.attach_ranks()
        assert isinstance(group, RankGroup)
        for rank, shard in enumerate(client.describe_pool().shards):  # each rank writes its own heads, nothing more
            assert group.ranks[rank].layout == shard.layout
            # its heads as a NumPy view (not contiguous): host data of any strides is copied, on either backend
            group.ranks[rank].write_slots(result.slot_mapping, kv[:, :, :, shard.heads.start:shard.heads.stop])
        assert np.array_equal(client.read_kv(seq), kv)
        assert np.array_equal(group.read_slots(result.slot_mapping), kv)
        for rank, shard in enumerate(client.describe_pool().shards):  # every replica of a head holds it
            got = group.ranks[rank].read_slots(result.slot_mapping)
            assert np.array_equal(got, kv[:, :, :, shard.heads.start:shard.heads.stop])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 4])
def test_copy_on_write_and_clearing_reach_every_rank(server_factory, n, backend):
    server = tp_server(server_factory, n, backend)
    with KVPoolClient(server.address) as client:
        group = client.attach_ranks()
        assert isinstance(group, RankGroup)
        layout = group.layout
        parent = client.register()
        first = client.append(parent, BS + 5)  # one full block and a shared partial one after the fork
        kv = kv_pattern(token_keys(1, 0, BS + 5), layout)
        group.write_slots(first.slot_mapping, kv)
        (child,) = client.fork(parent, 1)
        step = client.append(child, 1)  # copy-on-write of the partial block, on every rank
        assert len(step.copies) == 1
        src, dst = (int(b) for b in step.copies[0])
        copied = np.arange(dst * BS, dst * BS + 5)
        assert np.array_equal(group.read_slots(copied), kv[BS:])
        for rank, shard in enumerate(client.describe_pool().shards):
            view = group.ranks[rank]
            assert np.array_equal(view.read_slots(copied), kv[BS:, :, :, shard.heads.start:shard.heads.stop])
        # A block freed and handed to a new owner is cleared on every rank.
        client.free([parent, child])
        other = client.register()
        handed = client.append(other, 3 * BS)
        blocks = handed.new_block_ids
        assert set(blocks.tolist()) & set((first.slot_mapping // BS).tolist())  # written blocks change hands
        slots = (blocks[:, None] * BS + np.arange(BS)).reshape(-1)
        assert not group.read_slots(slots).any()
        assert client.check_invariants().ok


def test_attach_needs_a_rank_on_a_split_pool(server_factory):
    server = tp_server(server_factory, 2)
    with KVPoolClient(server.address) as client:
        with pytest.raises(InvalidArgumentError, match="rank"):
            client.attach()
        with pytest.raises(InvalidArgumentError, match="rank"):
            client.attach(rank=2)


def test_a_split_that_does_not_divide_is_refused():
    from kvpool_server.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="tensor-parallel 3"):
        load_config(["--num-kv-heads", "4", "--tensor-parallel", "3"], environ={})
    with pytest.raises(ConfigError, match="one a rank"):
        load_config(["--num-kv-heads", "4", "--tensor-parallel", "2", "--tp-devices", "0"], environ={})
    assert load_config(["--num-kv-heads", "4", "--tensor-parallel", "2", "--tp-devices", "0,1"],
                       environ={}).tp_device_list() == [0, 1]


def test_kvctl_stats_counts_every_rank(server_factory, capsys):
    from kvpool_client.kvctl import main

    server = tp_server(server_factory, 4)
    assert main(["stats", "--target", server.address, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tensor_parallel"] == 4 and data["pool_bytes"] == 128 * 16 * 512  # all four shards: 128 blocks
    assert main(["stats", "--target", server.address]) == 0
    assert "4 tensor-parallel shards" in capsys.readouterr().out
