"""What only AsyncKVPoolClient has, against a real kvpool-server process: many calls in flight on one channel, the
async context manager, results equal to the sync client's, grpc.aio's errors mapped. (The cases both clients share
are in test_client.py.) Plain pytest functions that drive coroutines with asyncio.run (no pytest-asyncio)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from kvpool_client import AsyncKVPoolClient, KVLayout, KVPoolClient
from kvpool_client.errors import ERROR_FOR_CODE, UnknownError, from_rpc_error


def run_with_client(address: str, body, **settings):
    """asyncio.run(body(client)) with an AsyncKVPoolClient made (and closed) inside that event loop."""

    async def main():
        async with AsyncKVPoolClient(address, **settings) as client:
            return await body(client)

    return asyncio.run(main())


def same(a, b) -> bool:
    return (a.seq_ids == b.seq_ids and all(np.array_equal(getattr(a, f), getattr(b, f))
                                           for f in ("num_tokens", "slot_mapping", "new_block_ids", "copies")))


def test_layout_is_a_coroutine_and_async_with_closes_the_channel(server):
    async def main():
        async with AsyncKVPoolClient(server.address) as client:
            assert await client.health() == "SERVING"
            assert await client.layout() == KVLayout() == (await client.describe_pool()).layout
        with pytest.raises(grpc.aio.UsageError, match="closed"):
            await client.stats()

    asyncio.run(main())


def test_concurrent_calls_on_one_channel(server):
    async def body(client):
        ids = await asyncio.gather(*(client.register() for _ in range(32)))
        assert len(set(ids)) == 32
        results = await asyncio.gather(*(client.append(seq_id, 17) for seq_id in ids))
        slots = np.concatenate([r.slot_mapping for r in results])
        assert len(np.unique(slots)) == 32 * 17  # no two sequences were given the same slot
        tables = await asyncio.gather(*(client.block_table(seq_id) for seq_id in ids))
        assert all(np.array_equal(t.slots(), r.slot_mapping) for t, r in zip(tables, results))
        assert (await client.check_invariants()).num_sequences_checked == 32
        assert sum(await asyncio.gather(*(client.free(seq_id) for seq_id in ids))) == 64
        assert (await client.stats()).num_blocks_used == 0

    run_with_client(server.address, body, timeout=5.0)


def test_results_equal_the_sync_clients_on_a_twin_server(server_factory):
    script = [("register", 1), ("register", 2), ("append", [1, 2], [17, 5]), ("append", [1, 2], 1),
              ("fork", 1, [9]), ("append", 9, 3), ("append", [2, 9, 1], np.array([1, 2, 3]))]
    first, second = server_factory(), server_factory()

    async def body(client):
        out = []
        for name, *args in script:
            out.append(await (client.fork(args[0], child_seq_ids=args[1]) if name == "fork"
                              else getattr(client, name)(*args)))
        return out, await client.stats(), [await client.block_table(s) for s in (1, 2, 9)]

    got, stats, tables = run_with_client(first.address, body)
    with KVPoolClient(second.address) as sync:
        want = [sync.fork(args[0], child_seq_ids=args[1]) if name == "fork" else getattr(sync, name)(*args)
                for name, *args in script]
        assert stats == sync.stats()
        assert all(np.array_equal(t.block_ids, sync.block_table(s).block_ids) for t, s in zip(tables, (1, 2, 9)))
    for a, b in zip(got, want):
        assert same(a, b) if hasattr(a, "slot_mapping") else a == b


@pytest.mark.parametrize("code", [*ERROR_FOR_CODE, grpc.StatusCode.DATA_LOSS])
def test_from_rpc_error_maps_aio_errors(code):
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="what happened")
    exc = from_rpc_error(error, "Stats")
    assert type(exc) is ERROR_FOR_CODE.get(code, UnknownError)
    assert exc.code == code and exc.details == "what happened" and exc.method == "Stats"
