"""ShardedTierPool: the host tier of a tensor-parallel pool -- one tier per shard, one slot-id space.

The core plans the tier in slots as it plans the pool in blocks, whatever N is; this tier carries each copy out on
every shard, the way ``ShardedPool`` carries out the pool's plans::

                      one HostTier (host_tier.py): slot s <-> block b
                                      |  pairs (block, slot)
                 +--------------------+--------------------+
                 v                    v                    v
    rank 0: tier [slots, 2L, seg/N]  rank 1: ...   rank N-1: ...   (HostTierPool or GpuTierPool of each shard)

Slot ``s`` of the group is slot ``s`` of every shard's tier, holding that shard's heads of the block: a copy
(either way) is done when it is done on every shard, and failed if it failed on any (then, as for one tier, none
of its pairs may be trusted: the caller aborts or fences them all). A write-back is started on every shard before
any is waited for (GPU shards copy at once). The group's ``ready_slots`` is the least of the shards' (each
allocates in the background): ``on_ready`` is told once every shard has a slot's memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool_server.offload.tier_pool import DEFAULT_CHUNK_BYTES, CopyTicket, TierPool


class GroupTicket(CopyTicket):
    """A write-back started on every shard: done when all are, completed when all completed."""

    def __init__(self, tickets: list[CopyTicket], parallel: bool) -> None:
        super().__init__()
        self.tickets = tickets
        self.parallel = parallel  # the shards copied at once (GPU streams) or one after another (NumPy)

    def done(self) -> bool:
        return all(t.done() for t in self.tickets)

    def wait(self) -> bool:
        return all([t.wait() for t in self.tickets])  # every one waited for, failed or not

    def seconds(self) -> float:
        each = [t.seconds() for t in self.tickets]
        return max(each, default=0.0) if self.parallel else sum(each)


class ShardedTierPool(TierPool):
    """``tiers[r]``: rank ``r``'s tier, beside ``pool.shard(r)``, ``num_slots`` slots each.

    Invariants: every shard's tier has ``num_slots`` slots; ``ready_slots`` is the least of theirs (it only
    grows); a copy is counted in ``copy_totals`` once, when it completed on every shard; the tiers are this one's
    alone (closed with it).
    """

    def __init__(self, pool: Any, num_slots: int, make_tier: Callable[..., TierPool],
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, on_ready: Callable[[int], None] = lambda n: None) -> None:
        super().__init__(pool, num_slots, chunk_bytes, on_ready)
        self.backend = pool.backend
        self._ready_lock = threading.Lock()
        self.tiers: list[TierPool] = []
        for rank in range(pool.tensor_parallel):
            self.tiers.append(make_tier(pool.shard(rank), num_slots, chunk_bytes, self._shard_ready))
        self.slot_bytes = sum(t.slot_bytes for t in self.tiers)
        self.chunk_slots = self.tiers[0].chunk_slots

    def _shard_ready(self, _: int) -> None:
        with self._ready_lock:  # one shard's thread at a time: on_ready sees the count grow, never shrink
            ready = min(t.ready_slots for t in self.tiers)
            if ready > self.ready_slots:
                self.ready_slots = ready
                self.on_ready(ready)

    def start(self) -> None:
        for tier in self.tiers:
            tier.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        for tier in self.tiers:
            tier.wait_ready(timeout)
        return self.ready_slots == self.num_slots

    def inject_failures(self, count: int = 1, offloads: bool = True, restores: bool = True) -> None:
        """Test hook: the last shard's next copies fail (the others' succeed: the group's copy fails all the same)."""
        self.tiers[-1].inject_failures(count, offloads, restores)

    def fail_every(self, n: int) -> None:
        self.tiers[-1].fail_every(n)

    def offload_blocks(self, pairs: Any) -> int:
        """Every shard's copy started, then every one waited for; raises if any failed."""
        ticket = self.start_offload(pairs)
        if not ticket.wait():
            raise OSError(f"a host-tier offload of {len(np.asarray(pairs))} blocks failed on a shard")
        self._count(True, ticket.nbytes, ticket.seconds())
        return len(np.asarray(pairs))

    def start_offload(self, pairs: Any) -> CopyTicket:
        self._check_open()
        tickets: list[CopyTicket] = []
        try:
            for tier in self.tiers:
                tickets.append(tier.start_offload(pairs))
        except BaseException:
            for ticket in tickets:  # nothing may still be copying when the caller aborts the slots
                ticket.wait()
            raise
        ticket = GroupTicket(tickets, parallel=self.backend == "gpu")
        ticket.nbytes = sum(t.nbytes for t in tickets)
        return ticket

    def restore_blocks(self, pairs: Any) -> int:
        self._check_open()
        started = time.perf_counter()
        for tier in self.tiers:
            tier.restore_blocks(pairs)
        n = len(np.asarray(pairs))
        self._count(False, n * self.slot_bytes, time.perf_counter() - started)
        return n

    def _release(self) -> None:
        for tier in self.tiers:
            tier.close()
