"""The handshake table alone (``fastpath.handshake.Handshakes``), over real unix sockets: a token already sent is
taken at accept, one sent in pieces when it is whole, a silent peer waits without blocking anyone and is closed
when late or when the table is full (the oldest first); the invariants hold throughout."""

from __future__ import annotations

import selectors
import socket

from kvpool_server.fastpath.handshake import TOKEN_BYTES, Handshakes


def listener() -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"\0kvpool-test-handshakes-{id(sock)}"
    sock.bind(address)
    sock.listen(128)
    sock.setblocking(False)
    return sock, address


def connect(address: str, first: bytes = b"") -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    if first:
        sock.sendall(first)
    return sock


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


def test_tokens_whole_or_in_pieces_and_silent_peers_late_or_evicted():
    selector = selectors.DefaultSelector()
    table = Handshakes(selector, limit=4, timeout_s=5.0)
    lst, address = listener()
    token = bytes(range(TOKEN_BYTES))
    eager = connect(address, token)
    slow = connect(address, token[:5])
    silent = [connect(address) for _ in range(3)]
    ready = table.accept(lst, 16)
    assert [t for _, t in ready] == [token] and len(table) == 4  # the eager one, at once; the rest wait
    table.check_invariants()
    slow.sendall(token[5:])
    got = [table.readable(key.data) for key, _ in selector.select(1)]
    assert got == [token] and len(table) == 3
    table.check_invariants()
    more = [connect(address) for _ in range(3)]
    assert table.accept(lst, 16) == [] and len(table) == 4  # full: the two oldest silent ones closed
    assert [closed(s) for s in silent] == [True, True, False] and not any(closed(s) for s in more)
    table.check_invariants()
    more[0].close()  # a peer that goes away before its token leaves the table when it is read
    for key, _ in selector.select(1):
        table.readable(key.data)
    assert len(table) == 3
    table.expire(now=float("inf"))  # late: every waiting one closed
    assert len(table) == 0 and closed(silent[2]) and closed(more[1]) and table.closed == 6
    table.check_invariants()
    for sock in (eager, slow, *silent, *more, *(s for s, _ in ready)):
        sock.close()
    lst.close()
    selector.close()
