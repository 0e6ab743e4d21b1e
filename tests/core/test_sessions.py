"""SessionTable: ids, leases on a stepped clock, keep-alive streams, restart detection, invariants."""

import pytest

from kvpool_server.core import InvalidArgumentError, InvariantViolationError
from kvpool_server.core.errors import ServerRestartedError, SessionNotFoundError
from kvpool_server.core.sessions import SessionTable, new_server_epoch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def table(clock):
    return SessionTable(0x1234, default_ttl_s=2.0, max_ttl_s=10.0, clock=clock)


def test_ids_carry_the_epoch_and_never_repeat(table):
    ids = [table.open(f"c{i}").session_id for i in range(5)]
    assert len(set(ids)) == 5 and all(i >> 32 == 0x1234 for i in ids)
    table.close(ids[0])
    assert table.open().session_id not in ids
    table.check_invariants()


def test_lease_default_cap_and_expiry(table, clock):
    default, long, short = table.open(), table.open(lease_ttl_s=1000.0), table.open(lease_ttl_s=0.5)
    assert (default.lease_ttl_s, long.lease_ttl_s, short.lease_ttl_s) == (2.0, 10.0, 0.5)
    clock.now += 0.5
    assert [s.session_id for s in table.expired()] == [short.session_id]
    clock.now += 1.0
    table.renew(default.session_id)  # a heartbeat pushes the deadline a full TTL ahead
    clock.now += 1.0
    assert {s.session_id for s in table.expired()} == {short.session_id}
    clock.now += 1.0
    assert {s.session_id for s in table.expired()} == {short.session_id, default.session_id}
    assert table.remaining_s(long) == pytest.approx(6.5)


def test_negative_ttl_is_refused(table):
    with pytest.raises(InvalidArgumentError, match="lease_ttl_ms must be >= 0"):
        table.open(lease_ttl_s=-1)
    assert len(table) == 0


def test_unknown_closed_and_earlier_start_ids(table):
    session = table.open()
    table.close(session.session_id)
    with pytest.raises(SessionNotFoundError, match="is not live") as info:
        table.get(session.session_id)
    assert not isinstance(info.value, ServerRestartedError)
    with pytest.raises(ServerRestartedError, match="earlier start"):
        table.renew(0x9999 << 32 | 1)
    with pytest.raises(SessionNotFoundError):
        table.close(session.session_id)


def test_last_keep_alive_stream_closing_says_so(table):
    session = table.open()
    table.stream_opened(session.session_id)
    table.stream_opened(session.session_id)
    assert table.stream_closed(session) is False
    assert table.stream_closed(session) is True
    table.close(session.session_id)
    table.stream_opened  # a stream of a session already closed does not ask for a second end
    session.num_keep_alive_streams = 1
    assert table.stream_closed(session) is False


def test_epoch_is_random_and_nonzero():
    epochs = {new_server_epoch() for _ in range(20)}
    assert len(epochs) > 1 and all(0 < e < 2**32 for e in epochs)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda t, s: t._sessions.__setitem__(s.session_id + 7, s), "wrong id or epoch"),
        (lambda t, s: setattr(t, "_next_number", 1), "never handed out"),
        (lambda t, s: setattr(s, "num_keep_alive_streams", -1), "negative keep-alive"),
    ],
)
def test_each_invariant_fires(table, corrupt, message):
    session = table.open()
    table.check_invariants()
    corrupt(table, session)
    with pytest.raises(InvariantViolationError, match=message):
        table.check_invariants()
