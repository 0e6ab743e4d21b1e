"""The host tier's figures, each declared once: where the core reads it, its ``PoolStats`` field, its field of the
proto's ``HostTierStats`` and its Prometheus family. What follows from this table, and nothing else spells them:

    stats      tier_stats(tier)           PoolStats's host_tier_* fields, read from the HostTier (``read``)
    proto      grpc_api/messages.py       StatsResponse.host_tier, field by field (``proto``)
    metrics    offload/metrics.py         one family per figure with a ``metric``
    checked    tests/proto/test_stats_figures.py: PoolStats's fields, the proto's HostTierStats and the
               client's HostTierStats (kvpool_client/types.py) hold exactly the declared ones (a test, because
               those are typed records -- a generated one would be opaque to mypy -- and the proto is the wire)

Pure data (no import of the tier).
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any, NamedTuple


class TierFigure(NamedTuple):
    """One figure of the host tier. Its value comes from one of: the HostTier (``read``, into the PoolStats field
    ``stat``), the tier's copy totals (``copies``: a ``CopyTotals`` field, device/tier_pool.py), or a block count
    times the block's bytes (``per_block``: the PoolStats field it multiplies)."""

    proto: str  # its HostTierStats field ("": not on the wire)
    metric: str  # its Prometheus family ("": none)
    kind: str  # "counter" or "gauge"
    help: str
    stat: str = ""  # its PoolStats field (the core's)
    read: Callable[[Any], int] | None = None  # the core's value of it, from the HostTier
    copies: str = ""
    per_block: str = ""


def _sum(*names: str) -> Callable[[Any], int]:
    getters = [attrgetter(name) for name in names]
    return lambda tier: sum(get(tier) for get in getters)


TIER_FIGURES: tuple[TierFigure, ...] = (
    TierFigure("num_blocks", "kvpool_host_tier_blocks", "gauge", "Blocks of the host tier (--host-tier-bytes; 0: none)",
               "host_tier_blocks_total", attrgetter("num_slots")),
    TierFigure("num_blocks_ready", "kvpool_host_tier_blocks_ready", "gauge", "Of those, allocated (pinned) so far (the "
               "tier is allocated in the background)", "host_tier_blocks_ready", attrgetter("num_ready")),
    TierFigure("num_blocks_cached", "kvpool_host_tier_blocks_cached", "gauge", "Host-tier blocks holding a matchable "
               "block", "host_tier_blocks_cached", attrgetter("num_committed")),
    TierFigure("num_blocks_offloaded", "kvpool_host_tier_offloaded_blocks", "counter", "Blocks copied into the host "
               "tier (write-backs included)", "host_tier_blocks_offloaded", attrgetter("num_offloaded")),
    TierFigure("num_blocks_restored", "kvpool_host_tier_restored_blocks", "counter", "Blocks copied back from the "
               "host tier", "host_tier_blocks_restored", attrgetter("num_restored")),
    TierFigure("", "kvpool_host_tier_copy_failures", "counter", "Blocks of host-tier copies that failed (dropped)",
               "host_tier_copy_failures", _sum("num_offload_failed", "num_restore_failed")),
    TierFigure("num_blocks_used", "kvpool_host_tier_blocks_used", "gauge", "Ready host-tier blocks holding a block "
               "(cached, or being written back)", "host_tier_blocks_used", attrgetter("num_used")),
    TierFigure("num_blocks_written_back", "kvpool_host_tier_written_back_blocks", "counter", "Of the offloaded "
               "blocks, those copied ahead by the write-back", "host_tier_blocks_written_back",
               attrgetter("num_written_back")),
    TierFigure("num_offload_failures", "kvpool_host_tier_offload_failures", "counter", "Blocks of host-tier offloads "
               "that failed (aborted)", "host_tier_offload_failures", attrgetter("num_offload_failed")),
    TierFigure("num_blocks_fenced", "kvpool_host_tier_fenced_blocks", "counter", "Blocks of host-tier restores that "
               "failed or were cut short (fenced: dropped from the tier, a miss)", "host_tier_blocks_fenced",
               attrgetter("num_restore_failed")),
    TierFigure("num_blocks_torn", "kvpool_host_tier_torn_blocks", "counter", "Write-backs whose block was evicted "
               "while the copy read it (aborted, never matchable)", "host_tier_blocks_torn", attrgetter("num_torn")),
    TierFigure("num_blocks_dropped", "kvpool_host_tier_dropped_blocks", "counter", "Cached host-tier blocks the host "
               "LRU dropped to make room", "host_tier_blocks_dropped", attrgetter("num_dropped")),
    TierFigure("num_evictions_unkept", "kvpool_host_tier_unkept_evictions", "counter", "Evicted pool blocks the host "
               "tier did not keep (not written back yet, or no free slot)", "host_tier_evictions_unkept",
               attrgetter("num_unkept")),
    TierFigure("bytes_offloaded", "kvpool_host_tier_offloaded_bytes", "counter", "Bytes the host tier's completed "
               "offloads moved (write-backs included)", copies="bytes_offloaded"),
    TierFigure("offload_seconds", "kvpool_host_tier_offload_seconds", "counter", "Seconds those offloads took "
               "(bandwidth: the ratio of the two counters' rates)", copies="offload_seconds"),
    TierFigure("bytes_restored", "kvpool_host_tier_restored_bytes", "counter", "Bytes the host tier's completed "
               "restores moved", copies="bytes_restored"),
    TierFigure("restore_seconds", "kvpool_host_tier_restore_seconds", "counter", "Seconds those restores took",
               copies="restore_seconds"),
    TierFigure("bytes_total", "kvpool_host_tier_size_bytes", "gauge", "Bytes of the host tier (0: none)",
               per_block="host_tier_blocks_total"),
    TierFigure("bytes_ready", "kvpool_host_tier_ready_bytes", "gauge", "Of those, allocated (pinned) so far",
               per_block="host_tier_blocks_ready"),
)

CORE_FIGURES = tuple(f for f in TIER_FIGURES if f.stat)  # the PoolStats fields the core fills from the HostTier


def tier_stats(tier: Any) -> dict[str, int]:
    """The host tier's fields of PoolStats, read from ``tier`` (a HostTier)."""
    return {f.stat: f.read(tier) for f in CORE_FIGURES if f.read is not None}
