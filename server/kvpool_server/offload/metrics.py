"""The host tier's Prometheus families, one per figure its declaration (offload/tier_stats.py) names a metric for
(``metrics.PoolCollector`` adds them; every name is listed in docs/metrics.md): its blocks, its use, what it lost
(failed, fenced, torn, dropped, unkept), and its copies' bytes and seconds (bandwidth =
``rate(kvpool_host_tier_offloaded_bytes_total) / rate(kvpool_host_tier_offload_seconds_total)``). Read at scrape
time, as the pool's gauges are: the blocks from ``PoolStats``, the bytes and seconds from ``TierPool.copy_totals``.
Without a host tier every value is 0."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from prometheus_client.core import Metric

from kvpool_server.offload.tier_stats import TIER_FIGURES
from kvpool_server.core.types import PoolStats
from kvpool_server.offload.tier_pool import CopyTotals
from kvpool_server.figure_family import figure_family


def tier_families(pool: Callable[[Callable[[PoolStats], float]], float | None],
                  copied: Callable[[Callable[[CopyTotals], float]], float | None],
                  block_bytes: int | None = None) -> list[Metric]:
    """One family per declared figure with a metric (offload/tier_stats.py): the blocks from ``pool``, the copies'
    bytes and seconds from ``copied``; the byte gauges only with ``block_bytes``."""
    families: list[Metric] = []
    for f in TIER_FIGURES:
        if not f.metric or (f.per_block and block_bytes is None):
            continue
        if f.copies:
            value = copied(attrgetter(f.copies))
        elif f.per_block:
            value = pool(_times(attrgetter(f.per_block), block_bytes or 0))
        else:
            value = pool(attrgetter(f.stat))
        families.append(figure_family(f, value))
    return families


def _times(blocks: Callable[[PoolStats], int], block_bytes: int) -> Callable[[PoolStats], float]:
    return lambda s: blocks(s) * block_bytes
