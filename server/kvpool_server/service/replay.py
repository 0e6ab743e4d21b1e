"""ReplyCache: the first answer to each recent request id, so that a retried mutation is applied once.

A mutating request may carry a ``request_id`` (unique within its session). The service looks the id up before it
applies anything (``guard.CoreGuard.mutate``): a repeat of a request it already answered gets that answer again and
changes nothing; the same id with *different* request arguments is the caller's bug (INVALID_ARGUMENT), not a
retry. Answers are the service's plain results (an AppendPlan, a list of ids, a count), so a retry is answered the
same whichever transport carries it.

Keys and budgets are per tenant, so tenants cannot touch each other's retries (docs/security.md):

    key      (tenant, session_id, request_id); session-less requests are session 0 *of their tenant*: a tenant
             replaying another tenant's request id gets nothing of it (it is a new request of its own)
    window   the last ``max_entries_per_session`` answered ids of each (tenant, session), oldest evicted first,
             and at most ``max_bytes_per_tenant`` bytes of answers per tenant (its own oldest evicted first): a
             tenant's large replies never evict another tenant's entries
    bound    ``max_bytes_per_tenant`` x the number of tenants (the tokens file's; one without --auth-tokens); an
             entry is counted as its answer's bytes plus ``ENTRY_OVERHEAD`` (keys, fingerprint, containers)

A session's entries go when the session ends. A retry that comes after its entry was evicted is applied again --
the client library retries only within a few seconds, far inside the window (docs/api.md). Only successful
answers are cached: a failed call changed nothing, so applying its retry is exactly right.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool_server.core.errors import InvalidArgumentError

ENTRY_OVERHEAD = 320  # bytes an entry costs besides its answer: two dict slots, the key tuples, the fingerprint
DEFAULT_MAX_BYTES_PER_TENANT = 16 << 20


def fingerprint(*parts: Any) -> bytes:
    """A 16-byte digest of a request's arguments (ints, bytes, strings, int sequences and arrays, None): sha256's
    first 16 bytes (sha256 has the CPU's instructions: a 32k-token prompt's 256 KiB in ~0.3 ms, blake2b's ~1 ms)."""
    digest = hashlib.sha256()
    for part in parts:
        if part is None:
            digest.update(b"\x00N")
        elif isinstance(part, bytes):
            digest.update(b"\x00B%d:" % len(part) + part)
        elif isinstance(part, str):
            digest.update(b"\x00S" + part.encode())
        elif isinstance(part, int):
            digest.update(b"\x00I%d" % part)
        else:  # an int sequence (a protobuf repeated field, a list, an array): 1-2 us at 256 ints
            try:
                array = np.asarray(part, dtype=np.int64)
            except OverflowError:  # ids of 2**63 and above (uint64 fields): the same bytes as their int64 wrap
                array = np.asarray(part, dtype=np.uint64).view(np.int64)
            digest.update(b"\x00A%d:" % array.size + array.tobytes())
    return digest.digest()[:16]


def answer_bytes(answer: Any) -> int:
    """What an answer costs to keep (its arrays' bytes, or 8 per int)."""
    if isinstance(answer, np.ndarray):
        return int(answer.nbytes)
    if isinstance(answer, tuple):
        return sum(answer_bytes(a) for a in answer)
    if isinstance(answer, Sequence) and not isinstance(answer, (str, bytes)):
        return 8 * len(answer)
    return 8


Owner = tuple[int, int]  # (tenant, session_id)


class ReplyCache:
    """Invariant: for every tenant, ``_order[tenant]`` holds exactly the (session_id, request_id) keys of that
    tenant's entries in ``_entries``, oldest first, and ``_bytes[tenant]`` is the sum of their sizes, at most
    ``max_bytes_per_tenant``; no (tenant, session) holds more than ``max_entries_per_session`` entries; a tenant
    or owner with no entries has no key in any of the three dicts."""

    def __init__(self, max_entries_per_session: int = 1024,
                 max_bytes_per_tenant: int = DEFAULT_MAX_BYTES_PER_TENANT) -> None:
        self.max_entries_per_session = max_entries_per_session
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self._entries: dict[Owner, OrderedDict[int, tuple[bytes, Any, int]]] = {}
        self._order: dict[int, OrderedDict[tuple[int, int], None]] = {}
        self._bytes: dict[int, int] = {}

    def __len__(self) -> int:
        return sum(len(order) for order in self._order.values())

    @property
    def num_bytes(self) -> int:
        return sum(self._bytes.values())

    def num_bytes_of(self, tenant: int) -> int:
        return self._bytes.get(tenant, 0)

    def lookup(self, tenant: int, session_id: int, request_id: int, request_fingerprint: bytes) -> Any:
        """The cached answer to a repeat of ``request_id``, or None if it is new (or fell out of the window)."""
        entries = self._entries.get((tenant, session_id))
        hit = entries.get(request_id) if entries is not None else None
        if hit is None:
            return None
        if hit[0] != request_fingerprint:
            where = f"session {session_id:#x}" if session_id else "your session-less calls"
            raise InvalidArgumentError(
                f"request_id {request_id} was already used in {where} for a different request; "
                "a request id names one request (reuse it only to retry that same request)"
            )
        return hit[1]

    def store(self, tenant: int, session_id: int, request_id: int, request_fingerprint: bytes, answer: Any) -> None:
        size = answer_bytes(answer) + ENTRY_OVERHEAD
        if size > self.max_bytes_per_tenant:
            return  # would evict everything of the tenant and still not fit: a retry of it is applied again
        self._remove(tenant, session_id, request_id)
        owner = (tenant, session_id)
        entries = self._entries.setdefault(owner, OrderedDict())
        entries[request_id] = (request_fingerprint, answer, size)
        order = self._order.setdefault(tenant, OrderedDict())
        order[(session_id, request_id)] = None
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        if len(entries) > self.max_entries_per_session:
            self._remove(tenant, session_id, next(iter(entries)))
        while self._bytes.get(tenant, 0) > self.max_bytes_per_tenant:
            self._remove(tenant, *next(iter(self._order[tenant])))

    def drop_session(self, tenant: int, session_id: int) -> None:
        for request_id in list(self._entries.get((tenant, session_id), ())):
            self._remove(tenant, session_id, request_id)

    def _remove(self, tenant: int, session_id: int, request_id: int) -> None:
        owner = (tenant, session_id)
        entries = self._entries.get(owner)
        if entries is None or request_id not in entries:
            return
        self._bytes[tenant] -= entries.pop(request_id)[2]
        order = self._order[tenant]
        del order[(session_id, request_id)]
        if not entries:
            del self._entries[owner]
        if not order:
            del self._order[tenant], self._bytes[tenant]

    def check_invariants(self) -> None:
        for tenant, order in self._order.items():
            keys = {(s, r) for (t, s), entries in self._entries.items() if t == tenant for r in entries}
            assert keys == set(order), f"tenant {tenant}: the order and the entries differ"
            total = sum(e[2] for (t, _), entries in self._entries.items() if t == tenant for e in entries.values())
            assert total == self._bytes[tenant] <= self.max_bytes_per_tenant, f"tenant {tenant}: bytes {total}"
        assert set(self._bytes) == set(self._order), "a tenant without entries kept a key"
        assert all(0 < len(e) <= self.max_entries_per_session for e in self._entries.values())
