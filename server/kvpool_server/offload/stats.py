"""The host tier's fields of PoolStats (Stats.host_tier), beside the manager's own."""

from __future__ import annotations

from dataclasses import replace

from kvpool_server.core.types import PoolStats
from kvpool_server.offload.host_tier import HostTier


def with_tier(stats: PoolStats, tier: HostTier | None) -> PoolStats:
    """The manager's ``stats`` with ``tier``'s fields (``stats`` itself without a tier). A restored block's tokens
    are the host hits (``prefix_host_hit_tokens``; they count in ``prefix_hit_tokens`` too)."""
    if tier is None:
        return stats
    return replace(
        stats,
        prefix_host_hit_tokens=tier.num_restored * tier.manager.block_size,
        host_tier_blocks_total=tier.num_slots,
        host_tier_blocks_ready=tier.num_ready,
        host_tier_blocks_cached=tier.num_committed,
        host_tier_blocks_offloaded=tier.num_offloaded,
        host_tier_blocks_restored=tier.num_restored,
        host_tier_copy_failures=tier.num_offload_failed + tier.num_restore_failed,
        host_tier_blocks_used=tier.num_used,
        host_tier_blocks_written_back=tier.num_written_back,
        host_tier_offload_failures=tier.num_offload_failed,
        host_tier_blocks_fenced=tier.num_restore_failed,
        host_tier_blocks_torn=tier.num_torn,
        host_tier_blocks_dropped=tier.num_dropped,
        host_tier_evictions_unkept=tier.num_unkept,
    )
