"""The unary RPCs the clients make, one row each: the stub that serves it, its method, and whether it is retried.

Idempotent means "running it twice changes nothing a second time": those are retried on UNAVAILABLE (retry.py).
A mutating call that failed with UNAVAILABLE or DEADLINE_EXCEEDED may or may not have run on the server; it is
retried only when its request carries a session's ``request_id`` -- the server answers a repeat with the first
answer and applies it once -- and then on both codes.
AppendTokenStream is not here: it is a bidirectional stream, made by the sync client only (stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass

KVPOOL_STUB = "kvpool"  # kvpool.v1.KVPoolService
HEALTH_STUB = "health"  # grpc.health.v1.Health


@dataclass(frozen=True)
class Rpc:
    """One unary RPC: ``name`` is what its exceptions carry as ``.method``."""

    name: str
    idempotent: bool
    stub: str = KVPOOL_STUB
    renews_lease: bool = False  # a request naming a session renews its lease on the server (session_gate.py)

    @property
    def stub_method(self) -> str:
        """The stub's attribute for this RPC ("Health.Check" -> "Check")."""
        return self.name.rsplit(".", 1)[-1]


REGISTER_SEQUENCE = Rpc("RegisterSequence", idempotent=False, renews_lease=True)
REGISTER_SEQUENCES = Rpc("RegisterSequences", idempotent=False, renews_lease=True)
APPEND_TOKEN = Rpc("AppendToken", idempotent=False, renews_lease=True)
FORK = Rpc("Fork", idempotent=False, renews_lease=True)
FREE = Rpc("Free", idempotent=False, renews_lease=True)
WRITE_KV = Rpc("WriteKV", idempotent=False, renews_lease=True)
STATS = Rpc("Stats", idempotent=True)
GET_BLOCK_TABLE = Rpc("GetBlockTable", idempotent=True)
DESCRIBE_POOL = Rpc("DescribePool", idempotent=True)
READ_KV = Rpc("ReadKV", idempotent=True)
CHECK_INVARIANTS = Rpc("CheckInvariants", idempotent=True)
OPEN_SESSION = Rpc("OpenSession", idempotent=False)
CLOSE_SESSION = Rpc("CloseSession", idempotent=False)
LIST_SESSIONS = Rpc("ListSessions", idempotent=True)
LIST_SEQUENCES = Rpc("ListSequences", idempotent=True)
OPEN_FAST_PATH = Rpc("OpenFastPath", idempotent=False)  # fast_commands.py
HEALTH_CHECK = Rpc("Health.Check", idempotent=True, stub=HEALTH_STUB)
