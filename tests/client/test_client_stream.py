"""KVPoolClient.append_stream(): AppendStream.step() is append() over one AppendTokenStream; the same results, the
same exception classes, a failed step ends the stream, never retried."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvpool_client import (
    AppendStream,
    InvalidArgumentError,
    KVPoolClient,
    KVPoolClientError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)


def same(a, b) -> bool:
    return (a.seq_ids == b.seq_ids and all(np.array_equal(getattr(a, f), getattr(b, f))
                                           for f in ("num_tokens", "slot_mapping", "new_block_ids", "copies")))


def test_steps_equal_unary_appends_on_a_twin_server(server_factory):
    with KVPoolClient(server_factory().address) as streamed, KVPoolClient(server_factory().address) as unary:
        for c in (streamed, unary):
            for seq_id in (1, 2, 3):
                c.register(seq_id)
        with streamed.append_stream() as stream:
            assert isinstance(stream, AppendStream)
            script = [([1, 2, 3], [17, 5, 31]), *[([1, 2, 3], 1)] * 40, (2, 9), ([3, 1], np.array([2, 4]))]
            for seq_ids, num_tokens in script:
                a, b = stream.step(seq_ids, num_tokens), unary.append(seq_ids, num_tokens)
                assert same(a, b) and a.slot_mapping.dtype == np.int64 and a.copies.shape[1] == 2
            for c in (streamed, unary):
                c.fork(1, child_seq_ids=[7])
            a, b = stream.step([7, 1], [1, 1]), unary.append([7, 1], [1, 1])
            assert same(a, b) and a.copies.shape == (1, 2)  # copy-on-write through the stream
            assert np.array_equal(a.slots_of(7), streamed.block_table(7).slots(a.offsets[0] + 17 + 40 + 4, 1))
        assert streamed.stats() == unary.stats()


def test_a_failed_step_raises_the_unary_exception_and_ends_the_stream(server):
    with KVPoolClient(server.address) as client:
        a = client.register()
        with client.append_stream() as stream:
            stream.step(a, 3)
            with pytest.raises(InvalidArgumentError):
                stream.step([a], [1, 2])  # caught in the client: nothing sent, the stream goes on
            stream.step([a])
            with pytest.raises(NotFoundError, match="AppendTokenStream") as info:
                stream.step([a, 999])
            assert info.value.method == "AppendTokenStream"
            with pytest.raises(NotFoundError):
                stream.step([a])  # the stream is over: the same error again, nothing sent
        assert client.block_table(a).num_tokens == 4
        with client.append_stream() as stream:
            with pytest.raises(ResourceExhaustedError):
                stream.step([a, client.register()], 3000)  # 6000 tokens > the pool's 4096
        with client.append_stream() as stream:
            with pytest.raises(InvalidArgumentError):
                stream.step(0)  # the server's check
        assert client.stats().num_tokens == 4


def test_close_half_closes_and_a_closed_stream_refuses_steps(server):
    with KVPoolClient(server.address) as client:
        a = client.register()
        stream = client.append_stream()
        stream.step(a)
        stream.close()
        stream.close()  # idempotent
        with pytest.raises(KVPoolClientError, match="closed"):
            stream.step(a)
        dropped = client.append_stream()
        dropped.step(a)
        del dropped  # dropped unclosed: the stream is half-closed, not leaked
        assert client.block_table(a).num_tokens == 2


def test_steps_from_threads_are_serialized(server):
    with KVPoolClient(server.address) as client, client.append_stream() as stream:
        ids = [client.register() for _ in range(4)]
        results: dict[int, list] = {s: [] for s in ids}

        def run(seq_id: int) -> None:
            for _ in range(25):
                results[seq_id].append(stream.step(seq_id).slot_mapping[0])

        threads = [threading.Thread(target=run, args=(s,)) for s in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for seq_id in ids:  # each thread got its own answers: its sequence's slots, in order
            assert np.array_equal(results[seq_id], client.block_table(seq_id).slots())


def test_unreachable_server_fails_at_once_never_retried(tmp_path):
    with KVPoolClient(f"unix:{tmp_path}/nobody.sock", session=False) as client, client.append_stream() as stream:
        start = time.monotonic()
        with pytest.raises(UnavailableError):
            stream.step(1)
        assert time.monotonic() - start < 2.0


def test_shutdown_ends_a_stepping_stream_with_unavailable(server_factory):
    server = server_factory("--num-blocks", "4096")
    outcome: list = []
    with KVPoolClient(server.address) as client:
        ids = [client.register() for _ in range(16)]
        with client.append_stream() as stream:

            def loop() -> None:
                try:
                    while True:
                        stream.step(ids)
                        outcome.append("ok")
                except Exception as exc:  # noqa: BLE001 - the test checks which
                    outcome.append(exc)

            thread = threading.Thread(target=loop)
            thread.start()
            deadline = time.monotonic() + 20
            while len(outcome) < 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.stop() == 0, server.log()
            thread.join(30)
    assert isinstance(outcome[-1], UnavailableError), outcome[-1]
    assert outcome.count("ok") == len(outcome) - 1
