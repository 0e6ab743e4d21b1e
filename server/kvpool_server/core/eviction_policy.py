"""Which evictable blocks the prefix cache gives up first: the policy interface, LRU, and the choice by name.

The prefix cache keeps the set of evictable blocks (ref count 0, content kept: ``PrefixCache.evictable``, in the
order they were parked); a policy only ranks them. It hears of each block parked (``parked``: a use just ended),
taken back into use (``unparked``) and evicted (``evicted``), and names the victims (``victims``). docs/prefix-caching.md compares them on
replayed traffic (benchmarks/replay_trace.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from itertools import islice
from typing import Protocol

import numpy as np

from kvpool_server.core.errors import InvalidArgumentError
from kvpool_server.core.kv_event_types import CachedBlock
from kvpool_server.core.lrfu_eviction import DEFAULT_HALF_LIFE_TOKENS, LrfuEviction

PREFIX_EVICTION_POLICIES = ("lru", "lrfu")


class EvictionPolicy(Protocol):
    """Ranks the prefix cache's evictable blocks. Every method gets the cache's ``evictable`` (block id -> None,
    in park order) as it is at the call; the policy never changes it."""

    name: str

    def parked(self, block_ids: np.ndarray, entries: Mapping[int, CachedBlock], evictable: OrderedDict[int, None]) -> None:
        """``block_ids`` (cached; ``entries`` their content) reached ref count 0, in eviction order among
        themselves (a sequence's tail first), and are in ``evictable`` now."""

    def unparked(self, block_ids: np.ndarray) -> None:
        """``block_ids`` left ``evictable``, taken back into use (a prefix match: a use begins)."""

    def victims(self, evictable: OrderedDict[int, None], num: int) -> list[int]:
        """``num`` (<= len(evictable)) distinct evictable blocks to evict, the first to go first."""

    def evicted(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """``block_ids`` (with the ``hashes`` of what they held) left the cache."""

    def check_invariants(self, evictable: OrderedDict[int, None]) -> None:
        """Raises InvariantViolationError where the policy's own invariants (its class docstring) do not hold."""


class LruEviction:
    """The least recently parked first: ``evictable``'s own order. No state of its own (so no invariant)."""

    name = "lru"

    def parked(self, block_ids: np.ndarray, entries: Mapping[int, CachedBlock], evictable: OrderedDict[int, None]) -> None:
        pass

    def unparked(self, block_ids: np.ndarray) -> None:
        pass

    def victims(self, evictable: OrderedDict[int, None], num: int) -> list[int]:
        return list(islice(evictable, num))  # oldest first

    def evicted(self, block_ids: list[int], hashes: list[bytes]) -> None:
        pass

    def check_invariants(self, evictable: OrderedDict[int, None]) -> None:
        pass


def make_eviction_policy(name: str, num_blocks: int, block_size: int,
                         half_life_tokens: int | None = None) -> EvictionPolicy:
    """The policy called ``name`` (one of PREFIX_EVICTION_POLICIES) for a pool of ``num_blocks`` blocks of
    ``block_size`` tokens; LRFU's ``half_life_tokens`` (None: DEFAULT_HALF_LIFE_TOKENS; 0: the pool's tokens,
    ``num_blocks * block_size``). ``lrfu:N`` (for experiments): LRFU with a half-life of N tokens (``lrfu:pool``:
    the pool's)."""
    if name == "lru":
        return LruEviction()
    base, _, half_life = name.partition(":")
    if name == "lrfu" or base == "lrfu" and (half_life == "pool" or half_life.isdigit() and int(half_life) > 0):
        tokens = half_life_tokens if not half_life else 0 if half_life == "pool" else int(half_life)
        tokens = DEFAULT_HALF_LIFE_TOKENS if tokens is None else tokens or num_blocks * block_size
        return LrfuEviction(num_blocks, block_size, tokens)
    raise InvalidArgumentError(f"unknown prefix eviction policy {name!r}: one of {', '.join(PREFIX_EVICTION_POLICIES)}")
