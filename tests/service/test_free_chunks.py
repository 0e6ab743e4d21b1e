"""A Free too big for one lock hold (a fork family: millions of block references) is detached in one hold, all or
none, then released in chunks of at most MAX_REFS_PER_HOLD references, the event loop serving other calls between
chunks (service/freeing.py). No timing is asserted (the project has no timed tests): the structure is -- how much
work each lock hold does, and that other calls ran between the holds and saw a consistent pool. The longest hold is
printed (pytest -s)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.config import ServerConfig
from kvpool_server.core import SequenceNotFoundError
from kvpool_server.service.build import build_service
from kvpool_server.service.freeing import MAX_REFS_PER_HOLD, Freeing, free_rows, plan_chunks
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.answers import Offload
from kvpool_server.service.scope import CallScope
from tests.service.recording_lock import RecordingLock
from tests.service.service_helpers import connect

LENGTH = 8192  # tokens of the parent: 512 blocks of 16, so its 4,096-sequence family holds 2 M references
FAMILY = 4096


@pytest.fixture
def service() -> Iterator[tuple[KVPoolService, CallScope, RecordingLock]]:
    config = ServerConfig(backend="host", num_blocks=1 << 12, max_num_seqs=FAMILY, max_batch=FAMILY)
    svc, admission = build_service(config)
    lock = svc.guard.lock = RecordingLock()  # type: ignore[assignment]
    try:
        yield svc, CallScope(admission, None, None), lock
    finally:
        svc.guard.pool.close()


def family(svc: KVPoolService, scope: CallScope) -> list[int]:
    with scope.call("RegisterSequence") as call:
        parent = svc.register(call).seq_id
    with scope.call("AppendToken") as call:
        svc.append(call, [parent], [LENGTH], list(range(LENGTH)))  # tracked: its blocks are pending in a chain
    with scope.call("Fork") as call:
        return [parent, *svc.fork(call, parent, FAMILY - 1)]


async def free(svc: KVPoolService, scope: CallScope, ids: list[int], request_id: int = 0) -> int:
    """What the transport does: the answer, or an Offload's work run on a thread."""
    with scope.call("Free") as call:
        answer = svc.free(call, ids, request_id=request_id)
    if isinstance(answer, Offload):
        return await asyncio.get_running_loop().run_in_executor(None, answer.work)
    return answer


def test_a_free_of_a_fork_family_holds_the_lock_a_chunk_at_a_time_and_the_loop_serves_between(service) -> None:
    svc, scope, lock = service
    manager = svc.guard.manager
    ids = family(svc, scope)
    used = manager.stats().num_blocks_used
    released: list[int] = []  # block references each release hold dropped
    between: list[int] = []  # Stats calls served since the previous release hold
    release = manager.release_detached

    def recording_release(rows: list[int]) -> int:
        released.append(int(manager.tables.by_length.num_blocks[manager.tables.num_tokens[rows]].sum()))
        between.append(0)
        return release(rows)

    manager.release_detached = recording_release  # type: ignore[method-assign]

    async def scenario() -> int:
        stop = asyncio.Event()

        async def other_calls() -> None:
            while not stop.is_set():
                stats, _ = svc.stats(scope.call("Stats"))
                if released:
                    between[-1] += 1
                    assert stats.num_sequences == 0  # the whole family is gone from the first hold on
                    with pytest.raises(SequenceNotFoundError):
                        svc.block_table(scope.call("GetBlockTable"), ids[-1])
                    with lock._lock:  # unrecorded: the check is slow, and not the Free's
                        manager.check_invariants()  # a consistent pool between chunks
                await asyncio.sleep(0)

        others = asyncio.ensure_future(other_calls())
        await asyncio.sleep(0)
        lock.holds.clear()
        freed = await free(svc, scope, ids)
        stop.set()
        await others
        return freed

    freed = asyncio.run(scenario())
    print(f"\nFree of a {FAMILY}-sequence family of {LENGTH} tokens ({sum(released)} references): "
          f"{len(released)} release holds, the longest lock hold {max(lock.holds) * 1e3:.1f} ms")
    print(sorted(round(h * 1e3, 2) for h in lock.holds)[-12:])
    assert freed == used and manager.stats().num_blocks_used == 0 and manager.num_sequences == 0
    assert sum(released) == FAMILY * LENGTH // 16
    assert len(released) >= sum(released) // MAX_REFS_PER_HOLD and max(released) <= MAX_REFS_PER_HOLD
    assert all(n >= 1 for n in between[:-1]), between  # the loop served a call between every two chunks
    manager.check_invariants()


def test_a_retry_of_a_chunked_free_waits_for_it_and_gets_its_answer(service) -> None:
    svc, scope, _ = service
    ids = family(svc, scope)
    used = svc.guard.manager.stats().num_blocks_used

    async def twice() -> list[int]:
        return list(await asyncio.gather(free(svc, scope, ids, request_id=7), free(svc, scope, ids, request_id=7)))

    assert asyncio.run(twice()) == [used, used]
    assert svc.guard.manager.stats().num_blocks_used == 0


def test_a_big_free_naming_one_unknown_id_changes_nothing(service) -> None:
    svc, scope, _ = service
    ids = family(svc, scope)
    before = svc.guard.manager.stats()
    with pytest.raises(SequenceNotFoundError), scope.call("Free") as call:
        svc.free(call, [*ids[:-1], ids[0] ^ (1 << 40)])
    assert svc.guard.manager.stats() == before
    assert asyncio.run(free(svc, scope, ids)) == before.num_blocks_used


def test_chunks_keep_the_order_and_bound_references_and_rows() -> None:
    refs = np.array([3, 3, 3, 10, 1, 1, 1, 1])
    chunks = plan_chunks(list(range(8)), refs, max_refs=6, max_rows=3)
    assert chunks == [[0, 1], [2], [3], [4, 5, 6], [7]]
    assert plan_chunks([5], np.array([1 << 30])) == [[5]]  # one row over the bound: alone


def test_the_server_answers_a_chunked_free_whole(server_factory: Callable[..., Any]) -> None:
    server = server_factory("--num-blocks", "2048", "--max-num-seqs", "4096", "--max-batch", "4096")
    with connect(server.address) as stub:
        parent = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[parent], num_tokens=[2048]))
        children = list(stub.Fork(pb.ForkRequest(parent_seq_id=parent, num_children=FAMILY - 1)).child_seq_ids)
        reply = stub.Free(pb.FreeRequest(seq_ids=[parent, *children]))  # 524,288 references: 2 chunks
        assert reply.num_blocks_freed == 128
        stats = stub.Stats(pb.StatsRequest())
        assert (stats.num_sequences, stats.num_blocks_used) == (0, 0)
        stub.CheckInvariants(pb.CheckInvariantsRequest())
        with pytest.raises(grpc.RpcError) as err:
            stub.Free(pb.FreeRequest(seq_ids=[children[0]]))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def session_family(svc: KVPoolService, scope: CallScope) -> tuple[int, list[int]]:
    with scope.call("OpenSession") as call:
        session_id = svc.sessions.open(call, "beams", 60_000).session_id
    with scope.call("RegisterSequence") as call:
        parent = svc.register(call, session_id=session_id).seq_id
    with scope.call("AppendToken") as call:
        svc.append(call, [parent], [LENGTH], session_id=session_id)
    with scope.call("Fork") as call:
        return session_id, [parent, *svc.fork(call, parent, FAMILY - 1, session_id=session_id)]


def test_a_session_end_frees_its_sequences_at_once_and_their_blocks_a_chunk_at_a_time(service) -> None:
    svc, scope, _ = service
    manager = svc.guard.manager
    release, released = manager.release_detached, []

    def recording_release(rows: list[int]) -> int:
        released.append(len(rows))
        return release(rows)

    manager.release_detached = recording_release  # type: ignore[method-assign]

    async def close_one() -> tuple[int, int]:
        session_id, ids = session_family(svc, scope)
        used = manager.stats().num_blocks_used
        with scope.call("CloseSession") as call:
            answer = svc.sessions.close(call, session_id)
        assert isinstance(answer, Offload) and manager.num_sequences == 0 and not released  # gone, not yet released
        assert manager.stats().num_blocks_used == used
        reply = await asyncio.get_running_loop().run_in_executor(None, answer.work)
        assert reply == (FAMILY, used) and len(released) > 1
        return reply

    async def reap_one() -> None:
        released.clear()
        session_id, _ = session_family(svc, scope)
        svc.guard.sessions.get(session_id).deadline = 0.0  # the lease ran out
        assert svc.sessions.reap_expired() == 1 and manager.num_sequences == 0 and not released
        while manager.stats().num_blocks_used:
            await asyncio.sleep(0)  # the chunks run on the loop, one turn each
        assert len(released) > 1

    asyncio.run(close_one())
    asyncio.run(reap_one())
    manager.check_invariants()


def test_a_free_whose_loop_closed_is_finished_by_its_waiter(service) -> None:
    """Shutdown closes the loop; a copy thread waiting for a Free's chunks releases the rest itself."""
    svc, scope, _ = service
    manager = svc.guard.manager
    ids = family(svc, scope)
    used = manager.stats().num_blocks_used
    loop = asyncio.new_event_loop()

    async def start() -> Freeing:
        with svc.guard.lock:
            freeing = free_rows(svc.guard, manager.detach(ids))
            assert isinstance(freeing, Freeing)
            return freeing.start(svc.guard)

    freeing = loop.run_until_complete(start())
    loop.close()  # the chunks' callbacks never run
    assert freeing.wait() == used and manager.stats().num_blocks_used == 0 and not manager.detached_rows
    manager.check_invariants()


def test_a_big_free_off_the_loop_is_released_whole_in_its_hold(service) -> None:
    svc, scope, _ = service
    manager = svc.guard.manager
    ids = family(svc, scope)
    used = manager.stats().num_blocks_used
    with svc.guard.lock:
        freeing = free_rows(svc.guard, manager.detach(ids))
        assert isinstance(freeing, Freeing) and freeing.start(svc.guard).done.is_set()
    assert freeing.wait() == used and not freeing.chunks and manager.stats().num_blocks_used == 0
