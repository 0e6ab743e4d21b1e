"""Issue 30.7 and 30.8: the fast path honours every answer kind of the service as gRPC does (``service/answers.py``'s
adapter). A Free of more than 1,024 sequences (an ``Offload``: released in chunks) answered NotFoundError although it
was applied (the record was served again); a Free or Fork of a sequence with a ReadKV in flight (a ``Wait``) was
INTERNAL "no running event loop" with --auth-tokens (the pins looked up by the raw id), and without it the serving
thread slept while the copy lasted, so every other channel waited."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from kvpool_client import KVPoolClient

POOL = ("--num-blocks", "2048", "--head-dim", "8")


def test_a_fast_path_free_of_more_than_1024_sequences_answers_as_grpc(server_factory):
    fast_server, grpc_server = server_factory(*POOL), server_factory(*POOL)

    def script(address: str, fast: bool) -> tuple:
        with KVPoolClient(address, fast_path=fast) as client:
            ids = [client.register() for _ in range(1100)]
            client.append(ids, 3)
            freed = client.free(ids)  # more than MAX_ROWS_PER_HOLD rows: released in chunks, an Offload
            assert client.fast_path_open == fast  # the channel answered it and goes on
            again = client.append(client.register(), 1).slot_mapping.size
            stats = client.stats()
            return freed, again, stats.num_sequences, stats.num_blocks_used, client.check_invariants().ok

    assert script(fast_server.address, True) == script(grpc_server.address, False) == (1100, 1, 1, 1, True)


def _in_thread(fn) -> Future:
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


class HeldReads:
    """The pool's ``read_slots`` held until ``release()``: a big ReadKV's copy stays in flight (its sequence
    pinned) for as long as the test wants, without depending on how fast the machine copies."""

    def __init__(self, pool) -> None:
        self.pool, self.original = pool, pool.read_slots
        self.entered, self.released = threading.Event(), threading.Event()
        pool.read_slots = self._read

    def _read(self, slots):
        self.entered.set()
        assert self.released.wait(60), "never released"
        return self.original(slots)

    def hold(self) -> None:
        self.entered.clear()
        self.released.clear()

    def release(self) -> None:
        self.released.set()


@pytest.mark.parametrize("auth", [True, False], ids=["auth-tokens", "no-auth"])
def test_a_free_or_fork_waits_for_a_read_in_flight_without_holding_up_other_channels(tmp_path, auth):
    """In-process (the pool's copy is held for as long as the test says), the real gRPC server and fast-path
    thread, real clients over real shared memory."""
    from kvpool_server.config import load_config
    from kvpool_server.grpc_api.server import build_server
    from kvpool_server.service.kv_copies import INLINE_BYTES
    from tests.security.tenant_helpers import write_tokens

    flags = ["--backend", "host", "--num-blocks", "2048", "--head-dim", "8", "--address", "127.0.0.1:0"]
    if auth:
        flags += ["--auth-tokens", str(write_tokens(tmp_path / "tokens.toml"))]
    handle = build_server(load_config(flags))
    handle.start()
    held = HeldReads(handle.service.guard.pool)
    address = f"127.0.0.1:{handle.port}"
    token_a, token_b = ("tok-a", "tok-b") if auth else (None, None)
    a = KVPoolClient(address, token=token_a, timeout=20)
    reader = KVPoolClient(address, token=token_a, fast_path=False, session=False, timeout=60)
    b = KVPoolClient(address, token=token_b, timeout=5)  # another frontend: its own channel
    try:
        seq = a.register()
        tokens = INLINE_BYTES // reader.describe_pool().layout.token_bytes + 1  # a copy off the loop: pinned
        a.append(seq, tokens)
        b_seq = b.register()

        def while_held(call):
            held.hold()
            read = _in_thread(lambda: reader.read_kv(seq))
            assert held.entered.wait(20), "the ReadKV's copy did not start"
            waiting = _in_thread(call)
            for _ in range(20):  # other channels are served meanwhile (the old thread slept: b timed out)
                b.append(b_seq, 1)
            assert not waiting.done(), f"the call did not wait for the copy: {waiting.exception()!r}"
            held.release()
            assert read.result(30).shape[0] == tokens
            return waiting.result(30)

        children = while_held(lambda: a.fork(seq, 1))
        assert len(children) == 1 and a.block_table(children[0]).num_tokens == tokens
        assert while_held(lambda: a.free([seq, *children])) > 0
        assert a.fast_path_open and b.fast_path_open
        with KVPoolClient(address, token="tok-admin" if auth else None, fast_path=False, session=False) as ops:
            assert ops.stats().num_sequences == 1 and ops.check_invariants().ok  # b's
    finally:
        held.release()
        for client in (a, b, reader):
            client.close()
        handle.stop()


def test_with_auth_tokens_a_fast_path_fork_and_free_during_real_reads_are_applied(server_factory, tmp_path):
    """A real server process and real ReadKV copies (32 MiB each, a few tens of ms here): every fast-path Fork and
    Free sent while one is in flight is applied once and answers OK -- it was INTERNAL with --auth-tokens."""
    from tests.security.tenant_helpers import write_tokens

    tokens_file = write_tokens(tmp_path / "tokens.toml")
    server = server_factory("--num-blocks", "8192", "--head-dim", "128", "--auth-tokens", str(tokens_file))
    with KVPoolClient(server.address, token="tok-a", timeout=30) as a, \
            KVPoolClient(server.address, token="tok-a", fast_path=False, session=False, timeout=60) as reader:
        layout = reader.describe_pool().layout
        tokens = min((32 << 20) // layout.token_bytes, 8192 * layout.block_size // 2)
        seq = a.register()
        a.append(seq, tokens)
        for _ in range(5):
            read = _in_thread(lambda: reader.read_kv(seq))
            time.sleep(0.005)  # the ReadKV most likely reaches the server first (pinned for its copy)
            children = a.fork(seq, 2)
            assert len(children) == 2 and {a.block_table(c).num_tokens for c in children} == {tokens}
            a.free(children)
            assert read.result(60).shape[0] == tokens
            assert a.stats().num_sequences == 1
        assert a.fast_path_open


def test_a_big_fast_path_free_is_released_in_chunks_on_the_event_loop_as_on_grpc():
    """In-process, to see where each chunk is released: a Free of 1,100 sequences over the fast path goes in
    several lock holds, each a callback of the event loop (off the loop they would all go in one hold)."""
    from kvpool_server.config import load_config
    from kvpool_server.grpc_api.server import build_server

    handle = build_server(load_config(["--backend", "host", *POOL, "--address", "127.0.0.1:0"]))
    handle.start()
    manager, holds = handle.service.guard.manager, []
    original = manager.release_detached

    def release_detached(rows):
        holds.append((len(rows), threading.current_thread().name))
        return original(rows)

    manager.release_detached = release_detached
    try:
        with KVPoolClient(f"127.0.0.1:{handle.port}") as client:
            ids = [client.register() for _ in range(1100)]
            client.append(ids, 3)
            assert client.free(ids) == 1100 and client.fast_path_open
        assert [n for n, _ in holds] == [1024, 76], holds
        assert {name for _, name in holds} == {handle.loop.thread.name}, holds
    finally:
        handle.stop()
