"""``kvctl top``: poll Stats and show usage, rates and latency, refreshed in place (``rich``), or JSON lines.

Rates come from the difference of two Stats replies over the time between them, of counters that only grow (tokens
appended, cached blocks evicted, CoW copies, prompt tokens looked up in the prefix cache and those found, host-tier
offloads and restores): a rate of a level such as the tokens held would mix appends and frees into a number that
means neither (``-262/s``). Latency is that of the Stats call itself as kvctl measures it (the server's own RPC
latency is on its metrics endpoint, docs/metrics.md).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvpool_client.client import KVPoolClient
from kvpool_client.types import PoolStats


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic() when the reply came
    stats: PoolStats
    latency_s: float


RATES = ("appended_tokens_per_s", "evicted_blocks_per_s", "cow_copies_per_s", "prefix_lookup_tokens_per_s", "prefix_hit_tokens_per_s", "tier_offloads_per_s",
         "tier_restores_per_s")


def rates(prev: Sample, cur: Sample) -> dict[str, float]:
    """Per-second growth of the counters of two samples (each only grows while the server lives)."""
    dt = max(cur.at - prev.at, 1e-9)
    a, b = prev.stats, cur.stats
    tier_a, tier_b = a.host_tier, b.host_tier
    return {
        "appended_tokens_per_s": max(0, b.num_tokens_appended - a.num_tokens_appended) / dt,
        "evicted_blocks_per_s": max(0, b.num_blocks_evicted - a.num_blocks_evicted) / dt,
        "cow_copies_per_s": max(0, b.num_copies - a.num_copies) / dt,
        "prefix_lookup_tokens_per_s": max(0, b.prefix_query_tokens - a.prefix_query_tokens) / dt,
        "prefix_hit_tokens_per_s": max(0, b.prefix_hit_tokens - a.prefix_hit_tokens) / dt,
        "tier_offloads_per_s": (max(0, tier_b.num_blocks_offloaded - tier_a.num_blocks_offloaded) / dt
                                if tier_a and tier_b else 0.0),
        "tier_restores_per_s": (max(0, tier_b.num_blocks_restored - tier_a.num_blocks_restored) / dt
                                if tier_a and tier_b else 0.0),
    }


def snapshot(samples: deque[Sample]) -> dict:
    """What one refresh shows, as a dict (the --json line, and what the table is drawn from)."""
    cur = samples[-1]
    s = cur.stats
    latencies = np.array([x.latency_s for x in samples]) * 1e3
    return {
        "time": time.time(),
        "blocks_used": s.num_blocks_used, "blocks_total": s.num_blocks_total, "blocks_free": s.num_blocks_free,
        "blocks_evictable": s.num_blocks_evictable,
        "usage_ratio": s.utilization, "bytes_used": s.num_blocks_used * s.block_bytes, "sequences": s.num_sequences,
        "tokens": s.num_tokens, "internal_fragmentation_ratio": s.internal_fragmentation,
        "blocks_shared": s.num_blocks_shared, "cow_copies": s.num_copies,
        "host_tier": s.host_tier is not None,
        **(rates(samples[-2], cur) if len(samples) > 1 else dict.fromkeys(RATES, 0.0)),
        "stats_latency_ms_p50": float(np.percentile(latencies, 50)),
        "stats_latency_ms_max": float(latencies.max()),
    }


def render(view: dict, target: str, interval: float):  # -> rich renderable
    from rich.table import Table

    table = Table(title=f"kvctl top  {target}  (every {interval:g} s; Ctrl-C to quit)", title_justify="left",
                  show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column()
    width = 30
    filled = int(round(view["usage_ratio"] * width))
    cached = min(width - filled, int(round(view["blocks_evictable"] / max(1, view["blocks_total"]) * width)))
    bar = "[green]" + "█" * filled + "[/green][yellow]" + "▒" * cached + "[/yellow]" + "·" * (width - filled - cached)
    table.add_row("usage", f"{100 * view['usage_ratio']:.2f}%", bar)
    table.add_row("blocks", f"{view['blocks_used']:,} / {view['blocks_total']:,}",
                  f"{view['bytes_used'] / (1 << 20):,.2f} MiB used, {view['blocks_free']:,} free, "
                  f"{view['blocks_evictable']:,} evictable")
    table.add_row("evictable", f"{view['blocks_evictable']:,}", "prefix cache, held by no sequence (allocatable)")
    table.add_row("sequences", f"{view['sequences']:,}", "live")
    table.add_row("tokens", f"{view['tokens']:,}", "held by live sequences")
    table.add_row("appends", f"{view['appended_tokens_per_s']:,.0f}/s", "tokens appended (slots handed out)")
    table.add_row("evictions", f"{view['evicted_blocks_per_s']:,.1f}/s", "cached blocks evicted to make room")
    table.add_row("prefix lookups", f"{view['prefix_lookup_tokens_per_s']:,.0f}/s",
                  f"prompt tokens looked up; {view['prefix_hit_tokens_per_s']:,.0f}/s found cached")
    table.add_row("fragmentation", f"{100 * view['internal_fragmentation_ratio']:.2f}%", "internal (last blocks)")
    table.add_row("shared blocks", f"{view['blocks_shared']:,}", "")
    table.add_row("CoW copies", f"{view['cow_copies']:,}", f"{view['cow_copies_per_s']:,.1f}/s")
    if view["host_tier"]:
        table.add_row("host tier", f"{view['tier_offloads_per_s']:,.1f}/s",
                      f"blocks offloaded; {view['tier_restores_per_s']:,.1f}/s restored")
    table.add_row("Stats latency", f"{view['stats_latency_ms_p50']:.2f} ms", f"p50; max {view['stats_latency_ms_max']:.2f} ms")
    return table


def run_top(client: KVPoolClient, args: argparse.Namespace, window: int = 60) -> int:
    samples: deque[Sample] = deque(maxlen=window)

    def poll() -> dict:
        started = time.perf_counter()
        stats = client.stats()
        samples.append(Sample(time.monotonic(), stats, time.perf_counter() - started))
        return snapshot(samples)

    count = 0
    try:
        if args.json:
            while not args.iterations or count < args.iterations:
                print(json.dumps(poll()), flush=True)
                count += 1
                if not args.iterations or count < args.iterations:
                    time.sleep(args.interval)
            return 0
        try:
            from rich.live import Live
        except ImportError:
            print("kvctl top: needs the `rich` package (a dependency of kvpool-client): pip install rich")
            return 3
        with Live(render(poll(), args.target, args.interval), auto_refresh=False) as live:
            count = 1
            while not args.iterations or count < args.iterations:
                time.sleep(args.interval)
                live.update(render(poll(), args.target, args.interval), refresh=True)
                count += 1
    except KeyboardInterrupt:
        pass
    return 0
