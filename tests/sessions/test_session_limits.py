"""Sessions are bounded (issue 20, item 10): a server-wide --max-sessions, a bounded client_name, and listings in
pages -- against a real server, through the raw stub, the client library and kvctl."""

from __future__ import annotations

import json

import grpc
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import KVPoolClient
from kvpool_client.kvctl import main as kvctl_main
from kvpool_server.service.paging import MAX_CLIENT_NAME_BYTES, SESSION_ROW_BYTES, page_size
from tests.service.service_helpers import connect, expect_error

SMALL_MESSAGES = ("--max-message-bytes", str(64 << 10))  # a page then holds page_size(0, ...) sessions


def test_max_sessions_refuses_the_next_session_naming_the_flag(server_factory):
    server = server_factory("--max-sessions", "5")
    with connect(server.address) as stub:
        opened = [stub.OpenSession(pb.OpenSessionRequest(client_name=f"c{i}")).session_id for i in range(5)]
        error = expect_error(stub.OpenSession, pb.OpenSessionRequest(client_name="one too many"),
                             grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "--max-sessions=5" in error.details()
        stub.CloseSession(pb.CloseSessionRequest(session_id=opened[0]))
        stub.OpenSession(pb.OpenSessionRequest(client_name="room again"))  # a closed one makes room
        assert len(stub.ListSessions(pb.ListSessionsRequest()).sessions) == 5


def test_a_long_client_name_is_refused_and_never_logged(server):
    long_name = "x" * (16 << 20)
    with connect(server.address) as stub:
        error = expect_error(stub.OpenSession, pb.OpenSessionRequest(client_name=long_name),
                             grpc.StatusCode.INVALID_ARGUMENT)
        assert str(MAX_CLIENT_NAME_BYTES) in error.details() and len(error.details()) < 200
        multibyte = "é" * (MAX_CLIENT_NAME_BYTES // 2 + 1)  # fewer characters than the bound, more bytes
        expect_error(stub.OpenSession, pb.OpenSessionRequest(client_name=multibyte), grpc.StatusCode.INVALID_ARGUMENT)
        at_bound = "é" * (MAX_CLIENT_NAME_BYTES // 2)
        session_id = stub.OpenSession(pb.OpenSessionRequest(client_name=at_bound)).session_id
        assert stub.ListSessions(pb.ListSessionsRequest()).sessions[0].client_name == at_bound
        stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))
        assert len(stub.ListSessions(pb.ListSessionsRequest()).sessions) == 0
    assert "x" * 1000 not in server.log()


def test_list_sessions_pages_cover_every_session_once_in_id_order(server_factory, capsys):
    server = server_factory(*SMALL_MESSAGES)
    per_page = page_size(0, SESSION_ROW_BYTES, 64 << 10)
    count = 2 * per_page + 7
    name = "n" * MAX_CLIENT_NAME_BYTES  # the worst-case row: the page must still fit the message limit
    with connect(server.address) as stub:
        opened = [stub.OpenSession(pb.OpenSessionRequest(client_name=name, lease_ttl_ms=120_000)).session_id
                  for _ in range(count)]
        first = stub.ListSessions(pb.ListSessionsRequest())
        assert len(first.sessions) == per_page and first.next_page_token
        listed, token, pages = [], "", 0
        while True:
            reply = stub.ListSessions(pb.ListSessionsRequest(page_size=100, page_token=token))
            assert len(reply.sessions) <= 100
            listed += [s.session_id for s in reply.sessions]
            pages += 1
            token = reply.next_page_token
            if not token:
                break
        assert listed == sorted(opened) and pages == -(-count // 100)
        expect_error(stub.ListSessions, pb.ListSessionsRequest(page_token="not-a-token"),
                     grpc.StatusCode.INVALID_ARGUMENT)
        expect_error(stub.ListSequences, pb.ListSequencesRequest(page_token=first.next_page_token),
                     grpc.StatusCode.INVALID_ARGUMENT)  # a ListSessions token means nothing to ListSequences
    with KVPoolClient(server.address, session=False) as client:
        assert [s.session_id for s in client.list_sessions()] == sorted(opened)
    assert kvctl_main(["--target", server.address, "sessions", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["session_id"] for s in data["sessions"]] == sorted(opened)


@pytest.mark.parametrize("with_session", [False, True])
def test_list_sequences_pages_cover_every_sequence_once(server_factory, capsys, with_session):
    server = server_factory(*SMALL_MESSAGES)
    with KVPoolClient(server.address, session=with_session) as client:
        seq_ids = [client.register() for _ in range(300)]
        session_id = client.session_id or 0
        with connect(server.address) as stub:
            listed, token = [], ""
            while True:
                reply = stub.ListSequences(pb.ListSequencesRequest(session_id=session_id, page_size=64,
                                                                   page_token=token))
                assert len(reply.sequences) <= 64
                listed += [s.seq_id for s in reply.sequences]
                token = reply.next_page_token
                if not token:
                    break
            assert listed == sorted(seq_ids)
            client.free(seq_ids[:10])  # rows that end between pages are simply not listed
            reply = stub.ListSequences(pb.ListSequencesRequest(session_id=session_id, page_size=50))
            rest = stub.ListSequences(pb.ListSequencesRequest(session_id=session_id, page_size=1000,
                                                              page_token=reply.next_page_token))
            assert [s.seq_id for s in (*reply.sequences, *rest.sequences)] == sorted(seq_ids[10:])
        assert [s.seq_id for s in client.list_sequences(session_id or None)] == sorted(seq_ids[10:])
        argv = ["--target", server.address, "sequences", "--json"] + (["--session", str(session_id)] if session_id
                                                                        else [])
        assert kvctl_main(argv) == 0
        assert [s["seq_id"] for s in json.loads(capsys.readouterr().out)["sequences"]] == sorted(seq_ids[10:])
