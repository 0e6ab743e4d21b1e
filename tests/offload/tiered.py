"""A manager with a host tier for the tier's own tests, the driver's part (``offload.TierCopies``) done by hand:
every append's store plan (``HostTier.prepare_store`` of ``AppendPlan.evicted``) and every restore's is collected
in ``stores`` until the test runs them (``take_stores``: the pairs, for it to copy and ``commit`` or ``abort``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool_server.core import AppendPlan, KVCacheManager
from kvpool_server.offload import restore
from kvpool_server.offload.host_tier import NO_PAIRS, HostTier, StorePlan
from kvpool_server.offload.restore import StagedRestore


class Tiered:
    def __init__(self, num_blocks: int, block_size: int, tier_blocks: int, **kwargs: Any) -> None:
        self.manager = KVCacheManager(num_blocks, block_size, **kwargs)
        self.tier: HostTier = HostTier(self.manager, tier_blocks) if tier_blocks else None  # type: ignore[assignment]
        self.stores: list[StorePlan] = []  # planned, not run yet

    def append(self, *args: Any, **kwargs: Any) -> AppendPlan:
        plan = self.manager.append(*args, **kwargs)
        if self.tier is not None:  # (0 blocks: no tier, the plain core)
            self.stores.append(self.tier.prepare_store(plan.evicted))
        return plan

    def take_stores(self) -> StorePlan:
        """The stores planned since the last take, as one plan (wait: any of them waits)."""
        plans, self.stores = self.stores, []
        pairs = [p.pairs for p in plans if len(p.pairs)]
        return StorePlan(np.concatenate(pairs) if pairs else NO_PAIRS, any(p.wait for p in plans))

    def stage_restore(self, tenant: int | None, prompt: Sequence[int], public_prefix_len: int = 0
                      ) -> StagedRestore | None:
        if self.tier is None:
            return None
        staged = restore.stage_prompt(self.tier, tenant, prompt, public_prefix_len)
        if staged is not None:
            self.stores.append(staged.stores)
        return staged

    def finish_restore(self, staged: StagedRestore, ok: bool) -> int:
        return restore.finish(self.tier, staged, ok)

    def check_invariants(self) -> None:
        self.manager.check_invariants()
        if self.tier is not None:
            self.tier.check_invariants()
