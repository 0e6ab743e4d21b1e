"""Issue 33.2: every answer kind of the service -- a value, an error, an ``Offload``, a ``Wait`` -- is turned into a
reply by one adapter (``service/answers.honour``) that both transports call: the gRPC handlers and the fast path's
records. A new answer kind is added there, and no transport can honour it differently or not at all.

- Against real server processes: each kind through both transports, the same status and the same effect.
- In-process, with the adapter watched: each kind, through each transport, reaches it (a transport that serves a
  kind by itself -- calls the service and handles the answer -- fails here).
- The transports' sources name no answer kind: only the adapter does.
"""

from __future__ import annotations

import ast
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from kvpool_client import KVPoolClient, KVPoolClientError
from tests.fastpath.test_deferred_answers import HeldReads, _in_thread

POOL = ("--num-blocks", "2048", "--head-dim", "8")
BIG_FREE = 1100  # sequences: more than one lock hold's (freeing.MAX_ROWS_PER_HOLD), an Offload
SERVER = Path(__file__).resolve().parents[2] / "server" / "kvpool_server"
TRANSPORTS = ("kvpool_server.grpc_api.handlers", "kvpool_server.fastpath.records")
KINDS = ("value", "error", "offload", "wait")


def _outcome(call) -> tuple:
    """What a call answered: its value, or its error's class, status code and message."""
    try:
        return ("ok", call())
    except KVPoolClientError as exc:
        return (type(exc).__name__, exc.code, exc.details)


def _errors(client: KVPoolClient, seq: int) -> list[tuple]:
    """Calls the service refuses, each a different status, on the four ops the fast path carries."""
    return [
        _outcome(lambda: client.append(987654, 1)),  # not found
        _outcome(lambda: client.append([seq, 987654], 1)),  # all or none: seq does not grow
        _outcome(lambda: client.register(seq)),  # a live id
        _outcome(lambda: client.fork(seq, 1 << 20)),  # more children than max_batch
        _outcome(lambda: client.fork(987654, 1)),
        _outcome(lambda: client.free([seq, 987654])),  # all or none: seq stays
    ]


def test_every_answer_kind_answers_the_same_on_both_transports(server_factory):
    """Real server processes, one per transport, the same script: the same answers (values and statuses) and
    the same pool after each (an Offload: a Free released in chunks)."""

    def script(address: str, fast: bool) -> list:
        with KVPoolClient(address, fast_path=fast, timeout=30) as client:
            seq = client.register(41)
            grown = client.append(seq, 5)
            children = client.fork(seq, 2)
            answers: list = [seq, grown.slot_mapping.size, len(children), client.free(children[1:])]
            answers += _errors(client, seq)
            ids = [client.register() for _ in range(BIG_FREE)]
            client.append(ids, 3)
            answers.append(client.free(ids))  # an Offload
            assert client.fast_path_open == fast  # every answer above came over the transport under test
            stats = client.stats()
            answers += [client.block_table(seq).num_tokens, stats.num_sequences, stats.num_blocks_used,
                        client.check_invariants().ok]
            return answers

    fast, grpc = script(server_factory(*POOL).address, True), script(server_factory(*POOL).address, False)
    assert fast == grpc
    assert fast[0] == 41 and fast[-4:] == [5, 2, 1, True] and fast[-5] == BIG_FREE
    assert all(outcome[0] != "ok" for outcome in fast[4:10]), fast[4:10]


@pytest.fixture
def watched_adapter(monkeypatch):
    """``answers.honour`` watched: (the transport that called it, the kind of answer its call gave), each time."""
    from kvpool_server.service import answers

    seen: set[tuple[str, str]] = set()
    real = answers.honour

    def honour(invoke, encode, **kwargs):
        transport = sys._getframe(1).f_globals["__name__"]

        def watched():
            try:
                answer = invoke()
            except answers.Wait:
                seen.add((transport, "wait"))
                raise
            except Exception:
                seen.add((transport, "error"))
                raise
            seen.add((transport, "offload" if isinstance(answer, answers.Offload) else "value"))
            return answer

        return real(watched, encode, **kwargs)

    monkeypatch.setattr(answers, "honour", honour)
    return seen


def test_each_transport_hands_every_answer_kind_to_the_one_adapter(watched_adapter):
    """In-process (a Wait needs a copy held in flight for as long as the test says): every kind, through each
    transport, reached the adapter -- a transport that served one itself would be missing here."""
    from kvpool_server.config import load_config
    from kvpool_server.grpc_api.server import build_server
    from kvpool_server.service.kv_copies import INLINE_BYTES

    handle = build_server(load_config(["--backend", "host", *POOL, "--address", "127.0.0.1:0"]))
    handle.start()
    held = HeldReads(handle.service.guard.pool)
    address = f"127.0.0.1:{handle.port}"
    try:
        with KVPoolClient(address, fast_path=False, session=False, timeout=60) as reader:
            for fast in (True, False):
                with KVPoolClient(address, fast_path=fast, timeout=30) as client:
                    seq = client.register()
                    tokens = INLINE_BYTES // reader.describe_pool().layout.token_bytes + 1  # an offloaded read
                    client.append(seq, tokens)
                    _errors(client, seq)
                    ids = [client.register() for _ in range(BIG_FREE)]
                    client.append(ids, 1)
                    assert client.free(ids) == BIG_FREE
                    held.hold()
                    read = _in_thread(partial(reader.read_kv, seq))
                    assert held.entered.wait(20), "the ReadKV's copy did not start"
                    freeing = _in_thread(partial(client.free, [seq]))  # waits for the copy: a Wait
                    transport = TRANSPORTS[1] if fast else TRANSPORTS[0]
                    for _ in range(2000):  # until the Free has met the pin (not timed: at most 20 s)
                        if (transport, "wait") in watched_adapter or freeing.done():
                            break
                        time.sleep(0.01)
                    assert not freeing.done(), freeing.exception()
                    held.release()
                    assert read.result(30).shape[0] == tokens and freeing.result(30) > 0
                    assert client.fast_path_open == fast
    finally:
        held.release()
        handle.stop()
    missing = {(t, k) for t in TRANSPORTS for k in KINDS} - watched_adapter
    assert not missing, f"answer kinds a transport did not hand to the adapter: {sorted(missing)}"


def _names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | \
        {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} | \
        {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}


def test_no_transport_names_an_answer_kind_only_the_adapter_does():
    """The gRPC handlers and the fast path never look at an answer's kind (``Offload``, ``Wait``) nor run one
    (the adapter's private helpers): they call ``honour`` and await its ``Pending``."""
    for package in ("grpc_api", "fastpath"):
        for path in sorted((SERVER / package).glob("*.py")):
            named = _names(path) & {"Offload", "Wait", "_attempt", "_offloaded"}
            assert not named, f"{path.relative_to(SERVER)} handles an answer kind itself: {sorted(named)}"
    for module in (*TRANSPORTS, "kvpool_server.grpc_api.streams"):  # and a stream's messages
        path = SERVER / Path(*module.split(".")[1:]).with_suffix(".py")
        assert "honour" in _names(path), f"{module} does not call the adapter"
