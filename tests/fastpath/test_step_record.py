"""A scheduler's step -- a Free, an AppendToken and a RegisterSequences -- in one step record, against real server
processes: the same answers and pool state as the three calls over gRPC, each part all or none with its own
status (the parts after a refused one still made), hostile records refused unapplied, a record never applied
twice, a client killed mid-record reclaimed, and one round trip: no gRPC call, one record a step."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpool import fastpath as fp
from kvpool import fastpath_codec as codec
from kvpool import fastpath_step as step_codec
from kvpool_client import KVPoolClient, KVPoolClientError
from tests.fastpath.in_process import in_process_server, refusing_op
from tests.fastpath.test_fastpath import Worker, wait_for
from tests.grpc_counting import counting_grpc

POOL = ("--num-blocks", "512", "--head-dim", "8", "--max-batch", "8", "--max-seq-len", "4096",
        "--max-tokens-per-call", "9000")
INVALID_ARGUMENT = 3


def answer_of(result, name) -> tuple:
    """A StepResult, its seq ids named by their order of creation (servers number ids differently)."""
    out = []
    for part in (result.freed, result.appended, result.registered):
        if isinstance(part, KVPoolClientError):
            out.append(("error", type(part).__name__, part.code, part.details))
        elif part is None or isinstance(part, int):
            out.append(part)
        elif isinstance(part, list):
            out.append([(name(r.seq_id), r.num_cached_tokens, r.cached_block_ids.tolist()) for r in part])
        else:
            out.append((part.slot_mapping.tolist(), part.new_block_ids.tolist(), part.copies.tolist()))
    return tuple(out)


def workload(client: KVPoolClient) -> list:
    """Steps of a scheduler: lookups, their prompts appended and sealed, frees -- and parts refused (an unknown id
    to free, an append of 0 tokens, a register over --max-batch) beside parts that apply."""
    names: dict[int, int] = {}

    def name(seq_id: int) -> int:
        return names.setdefault(seq_id, len(names))

    base = np.arange(3, 3 + 400, dtype=np.uint32)
    out: list = []
    live: list[int] = []
    first = client.step(register=([base[:100], base[:70], base[200:260]], [b"", b"k", b""]))
    out.append(answer_of(first, name))
    seqs = [r.seq_id for r in first.registered]
    tokens = np.concatenate([base[:100], base[:70], base[200:260]])
    out.append(answer_of(client.step(append=(seqs, [100, 70, 60], tokens)), name))
    # seal them, free the second, look up again: the sealed blocks are found in the same step
    step = client.step(free=[seqs[1]], append=([seqs[0], seqs[2]], [1, 1], [1, 1]),
                       register=([base[:100], base[:70]], [b"", b"k"]))
    out.append(answer_of(step, name))
    live = [seqs[0], seqs[2]] + [r.seq_id for r in step.registered]
    # a Free refused (an unknown id, all or none), the append and the register still made
    out.append(answer_of(client.step(free=[live[0], 99_999], append=([live[1]], [3], None),
                                     register=([base[:40]], [])), name))
    out.append(answer_of(client.step(append=([live[1], 12_345], [1, 1], None), register=([base[:5]] * 9, [])), name))
    out.append(answer_of(client.step(free=[live[2]], append=(live[:2], [0, 1], None)), name))  # a count of 0
    out.append(answer_of(client.step(free=[live[3]]), name))
    out.append(answer_of(client.step(), name))
    for seq_id in (live[0], live[1]):
        table = client.block_table(seq_id)
        out.append((name(seq_id), table.block_ids.tolist(), table.num_tokens))
    out.append(client.stats())
    return out


def test_steps_over_the_fast_path_answer_as_the_three_grpc_calls_in_one_record_each(server_factory):
    fast_server, grpc_server = server_factory(*POOL), server_factory(*POOL)
    with KVPoolClient(fast_server.address) as fast, KVPoolClient(grpc_server.address, fast_path=False) as slow:
        fast.free(fast.register())  # the channel open
        calls = counting_grpc(fast)
        published = int(fast._fast_channel.views.ctl[fp.CTL_REQ_SEQ])
        fast_answers = workload(fast)
        records = int(fast._fast_channel.views.ctl[fp.CTL_REQ_SEQ]) - published
        assert calls == ["GetBlockTable", "GetBlockTable", "Stats"] and fast.fast_path_open, calls  # the reads
        assert records == 7  # a record a step (the empty one sends none)
        slow_answers = workload(slow)
        assert fast.check_invariants().ok and slow.check_invariants().ok
    assert fast_answers == slow_answers
    errors = [part for answer in fast_answers[3:6] for part in answer if isinstance(part, tuple) and part[0] == "error"]
    assert [e[1] for e in errors] == ["NotFoundError", "NotFoundError", "InvalidArgumentError", "InvalidArgumentError"]
    # sealed by the step's append, found by its register; the sequence it freed unsealed: never matchable
    assert fast_answers[2][2][0][1] == 96 and fast_answers[2][2][1][1] == 0


def hostile(channel, *, ids=(), counts=(), tokens=(), extra=b"", arg0=0, arg1=0, header: dict | None = None,
            request_id: int = 0) -> int:
    """A step record written by hand into the segment; returns its reply code."""
    views = channel.views
    codec.write_request(views, fp.OP_STEP, request_id, channel.generation, ids=np.asarray(ids, np.uint64),
                        counts=np.asarray(counts, np.uint32), tokens=np.asarray(tokens, np.uint32), extra=extra,
                        arg0=arg0, arg1=arg1)
    for word, value in (header or {}).items():
        views.req[word] = value
    return publish(channel)


def publish(channel, seq: int | None = None) -> int:
    views = channel.views
    seq = channel.seq + 1 if seq is None else seq
    codec.publish_request(views, seq)
    channel.seq = seq
    if views.ctl[fp.CTL_SERVER_PARKED]:
        channel.sock.send(b"w")
    channel._wait(views, seq, "hostile", 10.0)
    return int(views.rep[fp.REP_CODE])


def test_hostile_step_records_are_refused_whole_and_change_nothing(server_factory):
    server = server_factory(*POOL)
    with KVPoolClient(server.address) as client:
        a, b = client.register(), client.register()
        client.append([a, b], 40)
        channel = client._fast_channel
        before = client.stats()
        toks = list(range(40))
        cases = [
            dict(ids=[a, b], counts=[1], arg0=1, arg1=2),  # F + A past the ids
            dict(ids=[a, b], counts=[1], arg0=-1, arg1=1),  # a negative F
            dict(ids=[a, b], counts=[1, 1], arg0=1, arg1=1),  # counts not A + 2R
            dict(ids=[a, 0], counts=[1, 20, 0], tokens=toks[:21], arg0=1),  # free a, a prompt: counts not A + 2R
            dict(ids=[b, 0], counts=[2, 20, 0], tokens=toks[:21], arg1=1),  # append tokens neither 0 nor 2
            dict(ids=[0], counts=[20, 0], tokens=toks[:19]),  # a prompt past the tokens
            dict(ids=[3], counts=[20, 0], tokens=toks[:20], extra=b"ab"),  # a key past the extra bytes
            dict(ids=[(1 << 64) - 1, 1], counts=[10, 10, 0, 0], tokens=toks[:20], extra=b"a"),  # a sum that wraps
            dict(ids=[a], extra=b"xyz", arg0=1),  # key bytes with no prompt
            dict(ids=[a], arg0=1, request_id=7),  # a request id: never replayed, so refused
            dict(ids=[a], arg0=1, header={fp.REQ_N_IDS: -1}),
            dict(ids=[a], arg0=1, header={fp.REQ_N_COUNTS: 1 << 40}),
            dict(ids=[a], arg0=1, header={fp.REQ_EXTRA_LEN: 1 << 20}),
            dict(ids=[a], arg0=1, header={fp.REQ_GENERATION: channel.generation + 1}),
        ]
        for case in cases:
            assert hostile(channel, **case) == INVALID_ARGUMENT, case
            after = client.stats()
            assert (after.num_sequences, after.num_blocks_used) == (before.num_sequences, before.num_blocks_used)
        # lies about ids inside a consistent record: each part refused by its own checks, nothing of it applied
        assert hostile(channel, ids=[a, a, 0, 777, a, b], counts=[1, 1, 1], arg0=3, arg1=3) == 0
        statuses = step_codec.read_step_reply(channel.views).statuses
        assert [code for code, _, _ in statuses] == [INVALID_ARGUMENT, 5, 0], statuses  # repeated id; NOT_FOUND
        assert client.stats().num_sequences == before.num_sequences
        assert client.check_invariants().ok
        result = client.step(free=[a], append=([b], [1], None), register=([np.arange(40, dtype=np.uint32)], []))
        assert result.freed == 3 and result.appended.slot_mapping.size == 1 and client.fast_path_open  # 40 tokens


def test_a_step_record_is_applied_once_whatever_the_client_publishes_after_it(server_factory):
    server = server_factory(*POOL)
    with KVPoolClient(server.address) as client:
        a, b = client.register(), client.register()
        channel = client._fast_channel
        assert hostile(channel, ids=[a, b], counts=[5], arg0=1, arg1=1) == 0
        assert client.block_table(b).num_tokens == 5 and client.stats().num_sequences == 1
        # the same record's bytes under the next seq (CTL_REQ_SEQ raised, its header left naming the old one, as a
        # client that resent it would leave it): refused, nothing applied again
        seq = channel.seq + 1
        channel.views.ctl[fp.CTL_REQ_SEQ] = seq
        channel.seq = seq
        if channel.views.ctl[fp.CTL_SERVER_PARKED]:
            channel.sock.send(b"w")
        channel._wait(channel.views, seq, "again", 10.0)
        assert int(channel.views.rep[fp.REP_CODE]) == INVALID_ARGUMENT
        assert client.block_table(b).num_tokens == 5 and client.stats().num_sequences == 1
        assert client.check_invariants().ok


def test_a_client_killed_mid_step_is_reclaimed(server_factory):
    server = server_factory(*POOL)
    worker = Worker(server.address, "step")
    time.sleep(0.3)  # step records flat out over the channel
    worker.kill()
    with KVPoolClient(server.address, fast_path=False, session=False) as observer:
        wait_for(lambda: observer.stats().num_sequences == 0, 5)
        assert observer.stats().num_blocks_used == 0
        assert observer.check_invariants().ok
        assert observer.list_sessions() == []


def test_a_server_that_does_not_know_the_record_gets_the_three_calls(monkeypatch):
    """A server of before the step record answers it INVALID_ARGUMENT "unknown op", unapplied: the client makes
    the three calls instead, and from then on at once (in-process: the server made to refuse the op)."""
    refusing_op(monkeypatch, fp.OP_STEP)
    with in_process_server() as handle:
        with KVPoolClient(f"127.0.0.1:{handle.port}", timeout=10) as client:
            a = client.register()
            published = int(client._fast_channel.views.ctl[fp.CTL_REQ_SEQ])
            prompts = [np.arange(40, dtype=np.uint32), np.arange(20, dtype=np.uint32)]
            result = client.step(free=[a], register=(prompts, []))
            assert result.freed == 0 and [r.num_cached_tokens for r in result.registered] == [0, 0]
            assert int(client._fast_channel.views.ctl[fp.CTL_REQ_SEQ]) == published + 3  # refused, free, register
            client.step(free=[r.seq_id for r in result.registered])
            assert int(client._fast_channel.views.ctl[fp.CTL_REQ_SEQ]) == published + 4  # at once
            assert client.stats().num_sequences == 0


def test_a_step_too_big_for_the_channel_goes_as_the_three_calls(server_factory):
    server = server_factory("--num-blocks", "2048", "--head-dim", "8", "--max-tokens-per-call", "40000",
                            "--fast-path-area-bytes", str(64 << 10))
    with KVPoolClient(server.address) as client:
        a = client.register()
        calls = counting_grpc(client)
        prompts = [np.arange(4000, dtype=np.uint32) + i for i in range(5)]  # 80 kB of tokens
        result = client.step(append=([a], [10], None), register=(prompts, []))
        assert result.appended.slot_mapping.size == 10 and len(result.registered) == 5
        assert calls == ["RegisterSequences"], calls  # the append alone over the fast path, the big one over gRPC


@pytest.mark.parametrize("transport", ["fast", "grpc"])
def test_a_dead_server_raises_from_step(server_factory, transport):
    server = server_factory(*POOL)
    client = KVPoolClient(server.address, fast_path=transport == "fast", timeout=5)
    try:
        a = client.register()
        server.kill()
        with pytest.raises(KVPoolClientError) as error:
            client.step(free=[a], register=([np.arange(40, dtype=np.uint32)], []))
        assert type(error.value).__name__ in ("ServerGoneError", "UnavailableError", "ConnectionFailedError")
    finally:
        client.close()


def test_a_step_whose_free_is_released_in_chunks_answers_as_the_three_grpc_calls(server_factory):
    pool = ("--num-blocks", "2048", "--head-dim", "8")
    fast_server, grpc_server = server_factory(*pool), server_factory(*pool)

    def script(address: str, fast: bool) -> tuple:
        with KVPoolClient(address, fast_path=fast) as client:
            ids = [client.register() for _ in range(1100)]
            client.append(ids, 3)
            other = client.register()
            result = client.step(free=ids, append=([other], [20], None),
                                 register=([np.arange(40, dtype=np.uint32)], []))  # over 1,024 rows: chunks
            assert client.fast_path_open == fast
            stats = client.stats()
            return (result.freed, result.appended.slot_mapping.size, len(result.registered),
                    client.block_table(other).num_tokens, stats.num_sequences, stats.num_blocks_used,
                    client.check_invariants().ok)

    assert script(fast_server.address, True) == script(grpc_server.address, False) == (1100, 20, 1, 20, 2, 2, True)


def test_a_step_whose_free_waits_for_a_read_in_flight_is_applied_once_when_it_ends():
    """In-process (the pool's copy held): the step's Free names a sequence a ReadKV is copying, so the Free waits
    (the service's Wait, raised before anything is applied); the record is served again once the copy is done --
    its append made once, not twice -- and other channels are served meanwhile."""
    from kvpool_server.config import load_config
    from kvpool_server.grpc_api.server import build_server
    from kvpool_server.service.kv_copies import INLINE_BYTES
    from tests.fastpath.test_deferred_answers import HeldReads, _in_thread

    handle = build_server(load_config(["--backend", "host", "--num-blocks", "2048", "--head-dim", "8",
                                       "--address", "127.0.0.1:0"]))
    handle.start()
    held = HeldReads(handle.service.guard.pool)
    address = f"127.0.0.1:{handle.port}"
    a = KVPoolClient(address, timeout=20)
    reader = KVPoolClient(address, fast_path=False, session=False, timeout=60)
    b = KVPoolClient(address, timeout=5)
    try:
        seq, other = a.register(), a.register()
        tokens = INLINE_BYTES // reader.describe_pool().layout.token_bytes + 1  # a copy off the loop: pinned
        a.append(seq, tokens)
        b_seq = b.register()
        held.hold()
        read = _in_thread(lambda: reader.read_kv(seq))
        assert held.entered.wait(20), "the ReadKV's copy did not start"
        waiting = _in_thread(lambda: a.step(free=[seq], append=([other], [5], None),
                                            register=([np.arange(40, dtype=np.uint32)], [])))
        for _ in range(20):
            b.append(b_seq, 1)
        assert not waiting.done(), f"the step did not wait for the copy: {waiting.exception()!r}"
        assert a.stats().num_sequences == 3  # nothing of it applied yet
        held.release()
        assert read.result(30).shape[0] == tokens
        result = waiting.result(30)
        assert result.freed > 0 and result.appended.slot_mapping.size == 5 and len(result.registered) == 1
        assert a.block_table(other).num_tokens == 5  # appended once
        assert a.stats().num_sequences == 3 and a.fast_path_open and a.check_invariants().ok
    finally:
        held.release()
        for client in (a, b, reader):
            client.close()
        handle.stop()


def test_the_asyncio_client_sends_the_record_with_the_same_answers(server_factory):
    from tests.client.blocking_aio import BlockingAsyncClient

    fast_server, grpc_server = server_factory(*POOL), server_factory(*POOL)
    fast = BlockingAsyncClient(fast_server.address)
    try:
        with KVPoolClient(grpc_server.address, fast_path=False) as slow:
            fast.free(fast.register())
            assert workload(fast) == workload(slow) and fast.fast_path_open
    finally:
        fast.close()
