"""MarkWatch: the pool's eviction policy as the host tier wraps it, so that the write-back's scan hint hears when
its mark is taken back into use (``HostTier.scan_from``)."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from kvpool_server.core.eviction_policy import EvictionPolicy
from kvpool_server.core.kv_event_types import CachedBlock


class ScanHint(Protocol):
    scan_skip: int
    scan_mark: int


class MarkWatch:
    """Forwards every call to the pool's ``policy``; an unpark of the write-back's scan mark (``hint.scan_mark``,
    the last block of the skipped run) voids the hint (``scan_skip = -1``: the next scan starts at the LRU's start).

    The hint is checked by the mark's position (the block ``scan_skip - 1`` of the LRU is still the mark), which
    holds while blocks only leave the run or join the LRU after it; a mark taken back into use and parked again
    is at the LRU's end, and could stand at the very position again with blocks before it that no scan looked at
    (the stateful tier test found such a sequence). O(blocks unparked) a call."""

    def __init__(self, policy: EvictionPolicy, hint: ScanHint) -> None:
        self.policy = policy
        # weakly: no cycle pool -> tier (a state copy that walks the core's objects field by field ends)
        self.hint: weakref.ref[ScanHint] = weakref.ref(hint)
        self.name = policy.name

    def parked(self, block_ids: np.ndarray, entries: Mapping[int, CachedBlock], evictable: OrderedDict[int, None]) -> None:
        self.policy.parked(block_ids, entries, evictable)

    def unparked(self, block_ids: np.ndarray) -> None:
        self.policy.unparked(block_ids)
        hint = self.hint()
        if hint is not None and hint.scan_skip > 0 and hint.scan_mark in block_ids.tolist():
            hint.scan_skip = -1

    def victims(self, evictable: OrderedDict[int, None], num: int) -> list[int]:
        return self.policy.victims(evictable, num)

    def evicted(self, block_ids: list[int], hashes: list[bytes]) -> None:
        self.policy.evicted(block_ids, hashes)

    def check_invariants(self, evictable: OrderedDict[int, None]) -> None:
        self.policy.check_invariants(evictable)

    def __getattr__(self, name: str) -> Any:  # the policy's own state (LRFU's), read through
        policy = self.__dict__.get("policy")  # (absent while a copy is being made: no recursion)
        if policy is None:
            raise AttributeError(name)
        return getattr(policy, name)
