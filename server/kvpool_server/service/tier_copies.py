"""TierCopies: the host tier's copies, run under the guard's lock in the order the core's plans need them.

    tier.flush()                                  # every mutation that may evict: the staged offloads, then commit
    tier.restore(tenant, prompt, public, extra)   # a register with a prompt, before the core's register

The order is what keeps KV right (docs/prefix-caching.md, "The host tier"):
- an evicted block is copied out *before* anything writes into it: ``flush`` runs right after the core's call and
  before the plan's clearing and copy-on-write copies (``KVPoolService.append``), and the copy has completed when
  ``offload_blocks`` returns; only then is the slot committed (matchable). A copy that raises aborts its slots.
- a restore's blocks enter the prefix cache only after ``restore_blocks`` returned; one that raises (or is cut
  short) fences its slots and leaves the fresh blocks free: the register that follows finds a miss there.
- a restore's own allocation may evict: those offloads run first (they read the blocks the restore then writes).

The lock is held across the copies (each completes before its call returns): correctness first. With 2 MiB blocks
an offload of one block costs ~50 us at host-link speed; moving offloads to a background committer (commit on the
copy's event, the evicted block pinned until then) is the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvpool_server.core import KVCacheManager
from kvpool_server.core.host_tier import HostTier
from kvpool_server.device.tier_pool import TierPool

logger = logging.getLogger(__name__)


class TierCopies:
    """The core's host tier (``manager.host_tier``) and its memory (``memory``), driven together."""

    def __init__(self, manager: KVCacheManager, memory: TierPool) -> None:
        assert manager.host_tier is not None
        self.manager = manager
        self.tier: HostTier = manager.host_tier
        self.memory = memory

    def flush(self) -> None:
        """Run the staged offloads; commit them when they completed, abort them when the copy raised."""
        tier = self.tier
        if not tier.staged:
            return
        pairs = tier.take_staged()
        slots = pairs[:, 1].tolist()
        try:
            self.memory.offload_blocks(pairs)
        except Exception as exc:
            logger.warning("host tier: an offload of %d blocks failed (%s): they are dropped", len(slots), exc)
            tier.abort(slots)
            return
        tier.commit(slots)

    def restore(self, tenant: int | None, prompt: Sequence[int] | np.ndarray, public_prefix_len: int = 0,
                cache_extra_key: bytes = b"") -> int:
        """Bring the prompt's host-tier blocks back into the pool before the core's register (whose match then
        finds them). Returns how many blocks were restored (0 on a failure: a miss)."""
        staged = self.manager.stage_restore(tenant, prompt, public_prefix_len, cache_extra_key)
        self.flush()  # the staging's allocation may have evicted: those blocks are read before they are written
        if staged is None:
            return 0
        try:
            self.memory.restore_blocks(staged.pairs)
        except Exception as exc:
            logger.warning("host tier: a restore of %d blocks failed (%s): a miss", len(staged.pairs), exc)
            self.manager.finish_restore(staged, ok=False)
            return 0
        self.manager.finish_restore(staged, ok=True)
        return len(staged.pairs)

    def make_ready(self, num_ready: int) -> None:
        """More of the tier's memory is there (called under the guard's lock)."""
        self.tier.make_ready(num_ready)
