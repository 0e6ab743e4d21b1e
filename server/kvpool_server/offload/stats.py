"""The host tier's fields of PoolStats (Stats.host_tier), beside the manager's own."""

from __future__ import annotations

from dataclasses import replace

from kvpool_server.core.types import PoolStats
from kvpool_server.offload.host_tier import HostTier
from kvpool_server.offload.tier_stats import tier_stats


def with_tier(stats: PoolStats, tier: HostTier | None) -> PoolStats:
    """The manager's ``stats`` with ``tier``'s fields (``stats`` itself without a tier). A restored block's tokens
    are the host hits (``prefix_host_hit_tokens``; they count in ``prefix_hit_tokens`` too)."""
    if tier is None:
        return stats
    return replace(stats, prefix_host_hit_tokens=tier.num_restored * tier.manager.block_size, **tier_stats(tier))
