"""FairShare: how much of the serving path each session has used lately, and whether it is over its share.

Every transport charges the seconds it spent serving a session (a fast-path record, a gRPC call's own work, a
chunk of a prompt's hashing on the hasher's thread: ``prompt_hasher``) to that session's entry; the entry decays
exponentially (time constant ``TAU_S``), so ``usage`` is about "the fraction of the server this session took over
the last ``TAU_S``" times ``TAU_S``. Then the share, max-min fair (water-filling)::

    the active sessions' usages, lowest first:  u1 <= u2 <= ... <= un           (capacity C = TAU_S: the whole server)
    level = the L with  sum(min(ui, L)) = C      sessions under L get all they ask; the others get L each
    a session is over its share  <=>  there are >= 2 active sessions and its usage > level

A session that uses less than its equal part is never over (whatever the others do); one that floods is held to
what the others leave -- and only while they are active (``ACTIVE_FRACTION`` of the server): alone it takes all.
``wait_s`` is how long until an over-share session's usage has decayed to the level; the transports act on it:
a gRPC call of that session awaits it (the event loop serves the others meanwhile), the fast path serves that
session's channel after the others', the hasher runs that session's chunks after the others' (never blocking).

Heavy work (the hasher's chunks, charged ``heavy=True``) also gives way to light work, whatever the share: a chunk
of a session waits (``pause_s``) while another session was served within RECENT_S -- one that is less used, or one
with no heavy work of its own within HEAVY_S (a frontend stepping back to back, however much of the server its
steps take) -- but never while its own usage is under MIN_SHARE of the server: heavy work is never starved, and a
flood of it costs the frontends that step meanwhile about MIN_SHARE of the server.

Bounded: one entry (and one "heavy lately" time) per key charged, keys being live sessions (``live``: a session
id no longer there is charged to its tenant's key, -1 - tenant) or one per tenant for calls without a session;
entries of ended sessions and entries decayed below ``DROP_S`` go at the next prune (every ``PRUNE_S``, from
``charge``), heavy times with their entry or once older than HEAVY_S.

Invariants (``check_invariants``): every entry's usage is >= 0 and finite; every session key is in ``live`` once
pruned; there are at most ``len(live)`` session entries plus one per tenant; every heavy time is of a key that
has an entry.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

TAU_S = 0.1  # the usage's time constant: what a session did longer ago than a few of these no longer counts
ACTIVE_FRACTION = 0.01  # a session that used less than this part of the server lately does not share it
DROP_S = 1e-6  # an entry decayed below this (seconds of work) is dropped at the next prune
PRUNE_S = 0.1  # how often entries of ended sessions and decayed ones are dropped
LEVEL_S = 0.001  # the level (and who was served lately) is recomputed at most this often
RECENT_S = 0.005  # a session served within this is "asking now": heavy work of a more-used session waits for it
HEAVY_S = 0.1  # a session with heavy work charged within this is not a light one (heavy work does not yield to it)
MIN_SHARE = 0.05  # heavy work of a session that used less than this part of the server lately never waits


class LiveSessions(Protocol):
    """The session table, as far as the accountant reads it."""

    def __contains__(self, session_id: int) -> bool: ...


def key_of(session_id: int, tenant: int | None, live: LiveSessions) -> int:
    """The entry a call is charged to: its session while live, else its tenant's (-1 - tenant)."""
    return session_id if session_id and session_id in live else -1 - (tenant or 0)


class FairShare:
    """The per-session decayed usage (see the module docstring). Thread-safe: charged from the event loop, the
    fast-path thread and the hasher's thread."""

    def __init__(self, live: LiveSessions, *, tau_s: float = TAU_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.live = live  # the session table (``in``): entries of ended sessions are pruned
        self.tau_s = tau_s
        self.clock = clock
        self._lock = threading.Lock()
        self._usage: dict[int, tuple[float, float]] = {}  # key -> (usage in seconds, when it was last decayed)
        self._pruned_at = 0.0
        self._level = math.inf
        self._level_at = -math.inf
        self._heavy: dict[int, float] = {}  # key -> when heavy work (the hasher's) was last charged to it
        # (usage, key, light) of the keys charged within RECENT_S, least used first (light: no heavy work lately)
        self._recent: list[tuple[float, int, bool]] = []
        self._over: dict[int, float] = {}  # key -> usage of the keys over their share (as of the last refresh)

    # ---------------------------------------------------------------- charging
    def charge(self, key: int, seconds: float, heavy: bool = False) -> None:
        """``seconds`` of serving ``key``; ``heavy``: of heavy work (a hasher's chunk: see ``pause_s``)."""
        self.charge_many({key: seconds}, heavy)

    def charge_many(self, spent: dict[int, float], heavy: bool = False) -> None:
        """``charge`` of each (key, seconds) of ``spent``, under one lock: the fast path folds what its thread
        served since the last fold (``fair_channels``: its thread never takes the lock per record)."""
        now = self.clock()
        tau = self.tau_s
        with self._lock:
            for key, seconds in spent.items():
                used, at = self._usage.get(key, (0.0, now))
                self._usage[key] = (used * math.exp((at - now) / tau) + max(0.0, seconds), now)
                if heavy:
                    self._heavy[key] = now
            if now - self._pruned_at >= PRUNE_S:
                self._prune(now)

    def forget(self, key: int) -> None:
        with self._lock:
            self._usage.pop(key, None)
            self._heavy.pop(key, None)

    def _prune(self, now: float) -> None:
        self._pruned_at = now
        live, tau = self.live, self.tau_s
        for key, (used, at) in list(self._usage.items()):
            if (key > 0 and key not in live) or used * math.exp((at - now) / tau) < DROP_S:
                del self._usage[key]
        for key, at in list(self._heavy.items()):
            if key not in self._usage or now - at > HEAVY_S:
                del self._heavy[key]

    # ---------------------------------------------------------------- reading
    def usage(self, key: int) -> float:
        """The key's decayed usage now, in seconds (0 for a key never charged)."""
        now = self.clock()
        used, at = self._usage.get(key, (0.0, now))
        return used * math.exp((at - now) / self.tau_s)

    def over_share(self) -> dict[int, float]:
        """The usage of every key over its share (as of the last refresh, at most LEVEL_S old): empty -- the
        usual case -- when nobody is, e.g. fewer than two sessions are active."""
        self.level()
        return self._over

    def level(self) -> float:
        """The max-min fair level (seconds of usage) above which a session is over its share; inf when fewer
        than two sessions are active. Recomputed at most every LEVEL_S."""
        now = self.clock()
        if now - self._level_at < LEVEL_S:
            return self._level
        self._refresh(now)
        return self._level

    def _refresh(self, now: float) -> None:
        tau = self.tau_s
        with self._lock:
            entries = [(u * math.exp((at - now) / tau), key, at) for key, (u, at) in self._usage.items()]
            heavy = dict(self._heavy)
        entries.sort()
        self._recent = [(used, key, now - heavy.get(key, -math.inf) > HEAVY_S) for used, key, at in entries
                        if now - at <= RECENT_S]
        active = [used for used, _, _ in entries if used >= ACTIVE_FRACTION * tau]
        level, remaining = math.inf, tau
        if len(active) >= 2:
            for i, used in enumerate(active):
                part = remaining / (len(active) - i)
                if used > part:
                    level = part
                    break
                remaining -= used
        self._level, self._level_at = level, now
        self._over = {key: used for used, key, _ in entries if used > level}

    def wait_s(self, key: int) -> float:
        """0 when ``key`` is within its share; else how long until its usage has decayed to the level."""
        used = self.usage(key)
        level = self.level()
        if used <= level:
            return 0.0
        return self.tau_s * math.log(used / level) if level > 0 else self.tau_s

    def pause_s(self, key: int) -> float:
        """For heavy work (``prompt_hasher``'s chunks) of ``key``: 0 to run it now, else how long to wait. It
        waits while another session was served within RECENT_S that is less used or light (no heavy work within
        HEAVY_S) -- light work first: a frontend stepping back to back keeps its latency -- and while ``key`` is
        over its share; never while ``key`` used less than MIN_SHARE of the server lately (heavy work is never
        starved)."""
        used = self.usage(key)
        if used < MIN_SHARE * self.tau_s:
            return 0.0
        if self._gives_way(key, used):
            return RECENT_S
        return self.wait_s(key)

    def _gives_way(self, key: int, used: float) -> bool:
        """Another key, less used than ``used`` or light, was charged within RECENT_S (as of the last refresh)."""
        self.level()  # refreshes ``_recent`` when it is older than LEVEL_S
        return any(other != key and (other_used < used or light) for other_used, other, light in self._recent)

    def __len__(self) -> int:
        return len(self._usage)

    def check_invariants(self) -> None:
        with self._lock:
            self._prune(self.clock())
            entries = dict(self._usage)
            heavy = dict(self._heavy)
        for key, (used, _) in entries.items():
            assert used >= 0 and math.isfinite(used), f"fair share: entry {key} has usage {used}"
            assert key < 0 or key in self.live, f"fair share: entry of ended session {key} kept after a prune"
        assert heavy.keys() <= entries.keys(), "fair share: a heavy time of a key without an entry"
