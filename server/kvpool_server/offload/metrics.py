"""The host tier's Prometheus families beyond its block gauges (``metrics.PoolCollector`` adds them; every name is
listed in docs/metrics.md): its use, what it lost (failed, fenced, torn, dropped, unkept), and its copies' bytes and
seconds (bandwidth = ``rate(kvpool_host_tier_offloaded_bytes_total) / rate(kvpool_host_tier_offload_seconds_total)``).
Read at scrape time, as the pool's gauges are: the blocks from ``PoolStats``, the bytes and seconds from
``TierPool.copy_totals``. Without a host tier every value is 0."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvpool_server.core.types import PoolStats
from kvpool_server.offload.tier_pool import CopyTotals


def tier_families(pool: Callable[[Callable[[PoolStats], float]], float | None],
                  copied: Callable[[Callable[[CopyTotals], float]], float | None]) -> list[Metric]:
    """The host tier's figures beyond its blocks (docs/metrics.md): use, losses, copy bytes and seconds."""

    def counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, value=value)

    return [
        GaugeMetricFamily("kvpool_host_tier_blocks_used", "Ready host-tier blocks holding a block (cached, or being "
                          "written back)", value=pool(lambda s: s.host_tier_blocks_used)),
        counter("kvpool_host_tier_written_back_blocks", "Of the offloaded blocks, those copied ahead by the write-back",
                pool(lambda s: s.host_tier_blocks_written_back)),
        counter("kvpool_host_tier_offload_failures", "Blocks of host-tier offloads that failed (aborted)",
                pool(lambda s: s.host_tier_offload_failures)),
        counter("kvpool_host_tier_fenced_blocks", "Blocks of host-tier restores that failed or were cut short "
                "(fenced: dropped from the tier, a miss)", pool(lambda s: s.host_tier_blocks_fenced)),
        counter("kvpool_host_tier_torn_blocks", "Write-backs whose block was evicted while the copy read it "
                "(aborted, never matchable)", pool(lambda s: s.host_tier_blocks_torn)),
        counter("kvpool_host_tier_dropped_blocks", "Cached host-tier blocks the host LRU dropped to make room",
                pool(lambda s: s.host_tier_blocks_dropped)),
        counter("kvpool_host_tier_unkept_evictions", "Evicted pool blocks the host tier did not keep (not written "
                "back yet, or no free slot)", pool(lambda s: s.host_tier_evictions_unkept)),
        counter("kvpool_host_tier_offloaded_bytes", "Bytes the host tier's completed offloads moved (write-backs "
                "included)", copied(lambda c: c.bytes_offloaded)),
        counter("kvpool_host_tier_offload_seconds", "Seconds those offloads took (bandwidth: the ratio of the two "
                "counters' rates)", copied(lambda c: c.offload_seconds)),
        counter("kvpool_host_tier_restored_bytes", "Bytes the host tier's completed restores moved",
                copied(lambda c: c.bytes_restored)),
        counter("kvpool_host_tier_restore_seconds", "Seconds those restores took",
                copied(lambda c: c.restore_seconds)),
    ]
