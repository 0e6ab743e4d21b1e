"""kvctl stats' prefix cache and host tier rows (kvctl.py adds them below the pool's): the hits by tier, the host
tier's blocks (and how much of it is allocated yet), its copies and their bandwidth, and what it lost. A server
without a host tier gets no tier row; one that never looked a prompt up, no hit row."""

from __future__ import annotations

from kvpool_client.types import PoolStats


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):,.2f} MiB"


def _took(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def bandwidth(num_bytes: int, seconds: float) -> str:
    """``num_bytes`` moved in ``seconds``, as a rate ("-" before any copy)."""
    if seconds <= 0:
        return "-"
    rate = num_bytes / seconds
    return f"{rate / (1 << 30):,.2f} GiB/s" if rate >= 1 << 30 else f"{rate / (1 << 20):,.2f} MiB/s"


def prefix_and_tier_rows(stats: PoolStats) -> list[tuple[str, str]]:
    rows = []
    tier = stats.host_tier
    if stats.prefix_query_tokens:
        hits = (f"{stats.prefix_hit_tokens:,} of {stats.prefix_query_tokens:,} prompt tokens "
                f"({100 * stats.prefix_hit_tokens / stats.prefix_query_tokens:.2f}%)")
        if tier is not None:
            hits += (f": {stats.prefix_hit_tokens - stats.prefix_host_hit_tokens:,} from the pool, "
                     f"{stats.prefix_host_hit_tokens:,} from the host tier")
        rows.append(("prefix cache hits", hits))
    if tier is None:
        return rows
    ready = "all ready" if tier.num_blocks_ready == tier.num_blocks else (
        f"{tier.num_blocks_ready:,} ready ({_mib(tier.bytes_ready)}), the rest being allocated")
    rows += [
        ("host tier", f"{tier.num_blocks_used:,} used ({tier.num_blocks_cached:,} cached) of {tier.num_blocks:,} "
                      f"blocks, {_mib(tier.bytes_total)}; {ready}"),
        ("host tier copies", f"{tier.num_blocks_offloaded:,} blocks offloaded ({tier.num_blocks_written_back:,} "
                             f"written back ahead), {tier.num_blocks_restored:,} restored"),
        ("host tier bandwidth", f"offload {bandwidth(tier.bytes_offloaded, tier.offload_seconds)} "
                                f"({_mib(tier.bytes_offloaded)} in {_took(tier.offload_seconds)}), restore "
                                f"{bandwidth(tier.bytes_restored, tier.restore_seconds)} ({_mib(tier.bytes_restored)} "
                                f"in {_took(tier.restore_seconds)})"),
        ("host tier losses", f"{tier.num_offload_failures:,} failed offloads, {tier.num_blocks_fenced:,} fenced "
                             f"restores, {tier.num_blocks_torn:,} torn write-backs, {tier.num_blocks_dropped:,} "
                             f"dropped (host LRU), {tier.num_evictions_unkept:,} evictions not kept"),
    ]
    return rows
