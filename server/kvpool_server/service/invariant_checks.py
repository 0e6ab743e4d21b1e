"""CheckInvariants without holding the pool: copy the manager's state under the lock (a few memcpys), check the copy
on a copy thread, one check at a time, at most ``DUTY`` of the time.

The full check reads every block table and ref count (100-300 ms at a million blocks); under the lock that stalled
every other client for as long. Here the lock is held only for the copy into buffers made at start-up (no page
faults: ~5 ms at a million blocks and 4096 sequences of 2048 blocks, far less at the default size). The copy is
generic -- every NumPy array of the manager and its parts is copied into the same-shaped buffer, anything else is
deep-copied -- so it follows the core's data model as that changes.

The check itself holds the GIL for much of its run, which slows the event loop beside it; so one check runs at a
time and, after a check that took t, the next starts no sooner than t * (1 / DUTY - 1) later: a client calling
CheckInvariants in a loop gets a check at most DUTY of the time, and waits (asynchronously, costing nothing) between.
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any, NamedTuple

import numpy as np

from kvpool_server.core import KVCacheManager
from kvpool_server.offload.host_tier import HostTier
from kvpool_server.service.answers import Offload, Wait

DUTY = 0.25


class InvariantReport(NamedTuple):
    """A check that passed (a failed one raises InvariantViolationError): what it covered."""

    num_blocks_checked: int
    num_sequences_checked: int


def copy_state(src: Any, dst: Any, skip: tuple[str, ...] = ()) -> None:
    """Make ``dst`` (a deep copy of ``src`` made earlier) equal to ``src`` again, reusing its arrays (but the fields
    named in ``skip``: parts copied on their own)."""
    into = vars(dst)
    for name, value in vars(src).items():
        if name in skip:
            continue
        current = into.get(name)
        if isinstance(value, np.ndarray):
            if (isinstance(current, np.ndarray) and current.shape == value.shape and current.dtype == value.dtype
                    and current.flags.writeable):
                np.copyto(current, value)
            else:
                into[name] = value.copy()
        elif type(value) is list and type(current) is list and len(current) == len(value):
            current[:] = copy.deepcopy(value)  # in place: a list the start-up heap froze stays frozen (gc_policy)
        elif type(value).__module__.startswith("kvpool_server.") and type(current) is type(value):
            copy_state(value, current)  # one of the core's objects: field by field, reusing its arrays
            # (not any object with a __dict__: an OrderedDict has one, empty, and its items would be lost)
        else:
            into[name] = copy.deepcopy(value)


class InvariantChecks:
    def __init__(self, manager: KVCacheManager, tier: HostTier | None = None) -> None:
        self.manager = manager
        self.tier = tier  # the host tier's bookkeeping (it reads the manager's cache): copied and checked with it
        # the buffers every check reuses (copied together: the tier's references land on the copy's parts)
        self._snapshot, self._tier_snapshot = copy.deepcopy((manager, tier))
        self._running = False
        self._next_at = 0.0  # loop time before which no new check starts
        self.last_lock_hold_s = 0.0
        self.last_check_s = 0.0

    def request(self, lock: Any) -> Offload:
        """CheckInvariants' body: an Offload of one check, or Wait for this call's turn."""
        loop = asyncio.get_running_loop()
        if self._running or loop.time() < self._next_at:
            raise Wait(self._turn())
        started = time.perf_counter()
        with lock:
            copy_state(self.manager, self._snapshot)
            if self.tier is not None:
                copy_state(self.tier, self._tier_snapshot, skip=("manager", "cache"))  # the manager's, copied above
        self.last_lock_hold_s = time.perf_counter() - started
        self._running = True
        snapshot, tier = self._snapshot, self._tier_snapshot

        def work() -> InvariantReport:
            snapshot.check_invariants()
            if tier is not None:
                tier.check_invariants()
            return InvariantReport(snapshot.num_blocks, snapshot.num_sequences)

        def finish() -> None:
            took = time.perf_counter() - started
            self.last_check_s = took
            self._running = False
            self._next_at = loop.time() + took * (1 / DUTY - 1)

        return Offload(work, finish)

    async def _turn(self) -> None:
        loop = asyncio.get_running_loop()
        while self._running or loop.time() < self._next_at:
            await asyncio.sleep(max(0.002, self._next_at - loop.time()))
