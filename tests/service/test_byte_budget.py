"""The byte budget of large request bodies (--max-inflight-bytes), in process: admission by size, first come first
served, bounded waiting, release on every path; and WriteKV's bulk field taken as a view, not a copy."""

from __future__ import annotations

import asyncio
import os
import tracemalloc

import numpy as np
import pytest

from kvpool.layout import KVLayout
from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.grpc_api.bulk import BulkRequest, split_bulk
from kvpool_server.service.byte_budget import MAX_UNREAD_WAITERS, ByteBudget
from kvpool_server.service.errors import Code, TooManyBytesError, status_of
from kvpool_server.service.kv_wire import KVWire

MiB = 1 << 20


def run(coro):
    return asyncio.run(coro)


def test_bodies_that_fit_are_charged_at_once_and_the_rest_wait_in_order():
    async def scenario() -> None:
        budget = ByteBudget(10 * MiB)
        await budget.acquire(6 * MiB, "WriteKV")
        await budget.acquire(4 * MiB, "WriteKV")
        assert budget.in_use == 10 * MiB
        order: list[str] = []

        async def wait(name: str, size: int) -> None:
            await budget.acquire(size, "WriteKV", 10.0)
            order.append(name)

        first = asyncio.create_task(wait("first", 5 * MiB))
        second = asyncio.create_task(wait("second", 1 * MiB))  # fits the room left later, but must not overtake
        await asyncio.sleep(0)
        assert budget.waiting_bytes == 6 * MiB and order == []
        budget.check()
        budget.release(4 * MiB)  # 4 MiB free: the 5 MiB head does not fit, so nobody goes
        await asyncio.sleep(0)
        assert order == [] and budget.in_use == 6 * MiB
        budget.release(6 * MiB)
        await asyncio.gather(first, second)
        assert order == ["first", "second"] and budget.in_use == 6 * MiB and budget.waiting_bytes == 0
        budget.check()
        budget.release(6 * MiB)
        assert budget.in_use == 0

    run(scenario())


def test_bodies_not_yet_read_wait_by_count_not_by_bytes():
    """An unread body (charged at the largest message before gRPC reads it) costs no memory while it waits: up to
    MAX_UNREAD_WAITERS wait, whatever their charge; the next is refused; they are granted in order."""
    async def scenario() -> None:
        budget = ByteBudget(8 * MiB)
        await budget.acquire(8 * MiB, "WriteKV", unread=True)
        waiters = [asyncio.create_task(budget.acquire(8 * MiB, "WriteKV", 30.0, unread=True))
                   for _ in range(MAX_UNREAD_WAITERS)]
        await asyncio.sleep(0)
        assert budget.num_unread_waiting == MAX_UNREAD_WAITERS and budget.waiting_bytes == 0
        budget.check()
        with pytest.raises(TooManyBytesError, match="no room to wait"):
            await budget.acquire(8 * MiB, "WriteKV", 30.0, unread=True)
        for granted in range(MAX_UNREAD_WAITERS):
            budget.release(8 * MiB)  # the next waiter is charged at once
            assert (budget.in_use, budget.num_unread_waiting) == (8 * MiB, MAX_UNREAD_WAITERS - granted - 1)
            budget.check()
        await asyncio.gather(*waiters)
        budget.release(8 * MiB)
        assert (budget.in_use, budget.num_unread_waiting) == (0, 0)

    run(scenario())


def test_a_body_is_refused_at_once_when_the_waiting_bytes_would_pass_the_budget():
    async def scenario() -> None:
        budget = ByteBudget(8 * MiB)
        await budget.acquire(8 * MiB, "WriteKV")
        waiter = asyncio.create_task(budget.acquire(8 * MiB, "WriteKV", 10.0))
        await asyncio.sleep(0)
        with pytest.raises(TooManyBytesError) as info:
            await budget.acquire(1 * MiB, "WriteKV", 10.0)
        status = status_of(info.value)
        assert status.code is Code.RESOURCE_EXHAUSTED and "--max-inflight-bytes" in status.message
        assert budget.waiting_bytes == 8 * MiB and budget.num_refused == 1
        budget.release(8 * MiB)
        await waiter
        assert budget.in_use == 8 * MiB
        budget.check()

    run(scenario())


def test_a_wait_that_runs_out_is_refused_and_leaves_nothing_charged():
    async def scenario() -> None:
        budget = ByteBudget(4 * MiB)
        await budget.acquire(3 * MiB, "WriteKV")
        with pytest.raises(TooManyBytesError, match="waited"):
            await budget.acquire(2 * MiB, "WriteKV", 0.01)
        assert (budget.in_use, budget.waiting_bytes) == (3 * MiB, 0)
        budget.check()

    run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_goes():
    async def scenario() -> None:
        budget = ByteBudget(8 * MiB)
        await budget.acquire(7 * MiB, "WriteKV")
        big = asyncio.create_task(budget.acquire(4 * MiB, "WriteKV", 10.0))
        await asyncio.sleep(0)
        small = asyncio.create_task(budget.acquire(1 * MiB, "WriteKV", 10.0))  # behind the big one
        await asyncio.sleep(0)
        assert not small.done()
        big.cancel()  # the client went away
        await small  # the head left: the small one fits now
        assert (budget.in_use, budget.waiting_bytes) == (8 * MiB, 0)
        budget.check()

    run(scenario())


def test_a_waiter_cancelled_just_as_it_is_granted_gives_the_bytes_back():
    async def scenario() -> None:
        budget = ByteBudget(4 * MiB)
        await budget.acquire(4 * MiB, "WriteKV")
        waiter = asyncio.create_task(budget.acquire(4 * MiB, "WriteKV", 10.0))
        await asyncio.sleep(0)
        budget.release(4 * MiB)  # grants the waiter (its future is set) ...
        waiter.cancel()  # ... and it is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (budget.in_use, budget.waiting_bytes) == (0, 0)
        budget.check()

    run(scenario())


def test_write_kv_data_is_a_view_of_the_body_and_decodes_without_a_copy():
    layout = KVLayout()
    data = os.urandom(4096 * layout.token_bytes)  # 2 MiB
    body = pb.WriteKVRequest(seq_id=7, start_position=16, data=data, session_id=3).SerializeToString()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        split = split_bulk(body, pb.WriteKVRequest.DESCRIPTOR.fields_by_name["data"].number)
        assert split is not None
        rest, view = split
        request = BulkRequest(pb.WriteKVRequest.FromString(rest), "data", view)
        tokens = KVWire(layout, 64 * MiB).decode(request.data)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 64 << 10, f"parsing a 2 MiB WriteKV allocated {grown} bytes"
    assert (request.seq_id, request.start_position, request.session_id) == (7, 16, 3)
    assert view.obj is body and tokens.shape[0] == 4096 and not tokens.flags.owndata
    assert np.array_equal(tokens.reshape(-1).view(np.uint8), np.frombuffer(data, np.uint8))


@pytest.mark.parametrize("body", [
    pb.WriteKVRequest(seq_id=1, data=b"x" * 100).SerializeToString()[:-1],  # truncated
    b"\x1b\x00\x1c",  # a group (wire type 3)
    b"\x08" + b"\xff" * 11,  # a varint too long
    b"".join(pb.WriteKVRequest(seq_id=i).SerializeToString() for i in range(1, 100)),  # many fields
])
def test_an_unusual_body_is_left_to_protobuf(body):
    assert split_bulk(body, 3) is None


def test_the_last_bulk_field_wins_as_in_protobuf():
    body = (pb.WriteKVRequest(data=b"first").SerializeToString()
            + pb.WriteKVRequest(seq_id=5, data=b"second").SerializeToString())
    rest, view = split_bulk(body, 3)
    assert bytes(view) == pb.WriteKVRequest.FromString(body).data == b"second"
    assert pb.WriteKVRequest.FromString(rest).seq_id == 5
