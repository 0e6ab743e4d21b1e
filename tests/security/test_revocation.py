"""A token revoked by SIGHUP stops working on the streams it opened too (issue 20.4): the call scope authenticates
every stream message, so an open AppendTokenStream is refused at its next message and a KeepAlive stream ends --
and with it the session it kept alive. Real server processes, real signals."""

from __future__ import annotations

import os
import queue
import signal
import time

import grpc

from kvpool.v1 import kvpool_pb2 as pb
from tests.security.tenant_helpers import TOKENS, As, code_of, write_tokens

U = grpc.StatusCode.UNAUTHENTICATED


class OpenStream:
    """A bidirectional stream fed from a queue, so the test decides when each message goes."""

    def __init__(self, method, metadata) -> None:  # type: ignore[no-untyped-def]
        self.requests: queue.Queue = queue.Queue()
        self.responses = method(iter(self.requests.get, None), metadata=metadata, timeout=30)

    def send(self, request):  # type: ignore[no-untyped-def]
        self.requests.put(request)
        return next(self.responses)

    def close(self) -> None:
        self.requests.put(None)


def revoke(server, tokens, who: str, still: As) -> None:  # type: ignore[no-untyped-def]
    write_tokens(tokens, {k: v for k, v in TOKENS.items() if k != who})
    os.kill(server.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while code_of(lambda: still.Stats(pb.StatsRequest())) != U:
        assert time.monotonic() < deadline, f"token {who} still accepted after SIGHUP"
        time.sleep(0.05)


def test_a_revoked_tokens_open_streams_are_refused_at_their_next_message(server_factory, tmp_path):
    tokens = write_tokens(tmp_path / "tokens.toml")
    server = server_factory("--auth-tokens", str(tokens))
    with grpc.insecure_channel(server.address) as channel:
        a, ops = As(channel, "tok-a"), As(channel, "tok-admin")
        seq = a.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        session = a.OpenSession(pb.OpenSessionRequest(client_name="revoked", lease_ttl_ms=60_000)).session_id
        appends = OpenStream(a.stub.AppendTokenStream, a.metadata)
        keep_alive = OpenStream(a.stub.KeepAlive, a.metadata)
        assert len(appends.send(pb.AppendTokenStreamRequest(seq_ids=[seq])).slot_mapping) == 1
        assert keep_alive.send(pb.KeepAliveRequest(session_id=session)).lease_remaining_ms > 0
        revoke(server, tokens, "a", a)

        for stream, request in ((appends, pb.AppendTokenStreamRequest(seq_ids=[seq])),
                                (keep_alive, pb.KeepAliveRequest(session_id=session))):
            try:
                stream.send(request)
                raise AssertionError("a message of a revoked token's stream was served")
            except grpc.RpcError as exc:
                assert exc.code() == U, exc
            finally:
                stream.close()
        # the append refused changed nothing, and the session the keep-alive held ended with its stream
        stats = ops.Stats(pb.StatsRequest())
        assert stats.num_tokens == 1
        deadline = time.monotonic() + 5
        while any(s.session_id == session for s in ops.ListSessions(pb.ListSessionsRequest()).sessions):
            assert time.monotonic() < deadline, "the revoked token's session outlived its keep-alive stream"
            time.sleep(0.05)
