"""The prefix-caching part of the summary and of the dashboard: token hit rate and prefill saved (shared-prefix and
chat), resident copies of each shared prompt, blocks used by beam search over a cached prompt, and the KV events a
subscriber consumed (with the server's evictable blocks)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from kvpool_client.loadgen.chat import make_chat_conversation, max_conversation_len
from kvpool_client.loadgen.resident import resident_copies_summary
from kvpool_client.loadgen.workload import (
    LengthDistribution,
    RequestSpec,
    make_request,
    make_shared_prefix_request,
)


def longest_sequence(a: argparse.Namespace, dist: LengthDistribution) -> int:
    """The longest a sequence of this workload can grow (preflight and the naive baseline use it)."""
    if a.workload == "shared-prefix":
        return a.shared_tokens + a.unique_tokens + dist.max_len
    if a.workload == "chat":
        return max_conversation_len(dist, a.turns, a.turn_tokens)
    return dist.max_len


def workload_means(a: argparse.Namespace, dist: LengthDistribution, count: int | None = None) -> dict[str, float]:
    """Mean prompt and output lengths of the run's requests (chat: of its turns) and the longest one; ``count``:
    of its first ``count`` requests only (an interrupted run: those started)."""
    specs: list[Any]
    n = a.completions if count is None else max(1, count)
    if a.workload == "chat":
        specs = []
        for i in range(n):
            conv = make_chat_conversation(a.seed, i, dist, a.turns, a.turn_tokens)
            specs += [RequestSpec(i, conv.prompt_len(k), (conv.sequence_len(k) - conv.prompt_len(k),))
                      for k in range(conv.num_turns)]
    elif a.workload == "shared-prefix":
        specs = [make_shared_prefix_request(a.seed, i, dist, a.num_prompts, a.shared_tokens, a.unique_tokens)
                 for i in range(n)]
    else:
        specs = [make_request(a.seed, i, dist, a.mode, a.num_samples) for i in range(n)]
    return {
        "mean_prompt_len": float(np.mean([s.prompt_len for s in specs])),
        "mean_output_len": float(np.mean([o for s in specs for o in s.output_lens])),
        "max_total_len": max(s.max_total_len for s in specs),
    }


def prefix_section(a: argparse.Namespace, counts: dict[str, int], workers: list[dict[str, Any]], t0: float,
                   t1: float, evictable_end: int) -> dict[str, Any]:
    """The summary's ``prefix``: what the requests asked for and what the cache gave them."""
    prompt_tokens, cached_tokens = counts.get("prompt_tokens", 0), counts.get("cached_tokens", 0)
    section: dict[str, Any] = {
        "caching": not a.no_prefix_cache,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "token_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "prefill_tokens_saved": cached_tokens,
        "prefill_tokens_computed": prompt_tokens - cached_tokens,
        "requests_with_hit": counts.get("requests_with_hit", 0),
        "evictable_blocks_end": evictable_end,
    }
    if a.workload == "chat":
        section["turns"] = counts.get("turns", 0)
        section["expected_cached_tokens"] = counts.get("expected_cached_tokens", 0)
    if a.workload == "shared-prefix":
        holds = [tuple(h) for w in workers for h in w.get("prefix_holds", [])]
        section["resident_copies"] = resident_copies_summary(holds, t0, t1)
    return section


def beam_section(memory: dict[str, Any], sharing: dict[str, Any]) -> dict[str, Any]:
    """Beam search over a cached prompt: the server's peak blocks used against each beam holding its full copy
    (neither caching nor sharing). Sharing without caching is ``peak_blocks_used`` of a --no-prefix-cache run."""
    peak_used, peak_unshared = memory["peak_used_blocks"], sharing["peak_blocks_without_sharing"]
    return {
        "peak_blocks_used": peak_used,
        "peak_blocks_no_caching_no_sharing": peak_unshared,
        "blocks_saved_at_peak": 1 - peak_used / peak_unshared if peak_unshared else 0.0,
    }


def events_section(events: dict[str, Any] | None, stats_series: dict[str, list[float]]) -> dict[str, Any]:
    """The summary's ``events``: the subscriber's counts, and the server's evictable blocks (Stats) over the run."""
    evictable = stats_series.get("evictable", [])
    out = dict(events or {"available": False, "error": "no subscriber"})
    out["peak_blocks_evictable"] = int(max(evictable, default=0))
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def render_prefix(summary: dict[str, Any]) -> list[str]:
    """The dashboard's prefix-caching lines (none for the standard workload)."""
    cfg, prefix = summary["config"], summary.get("prefix")
    if not prefix:
        return []
    if cfg["workload"] == "chat":
        what = f"chat: {cfg['completions']} conversations x {cfg['turns']} turns, {cfg['turn_tokens']}-token messages"
    else:
        what = (f"prefix cache: {cfg['num_prompts']} shared prompts x {cfg['shared_tokens']} tokens + "
                f"{cfg['unique_tokens']} unique tokens per request")
    lines = [
        "-" * 78,
        f" {what}" + ("" if prefix["caching"] else "   [--no-prefix-cache]"),
        f"   prompt tokens {prefix['prompt_tokens']:,}   cached {prefix['cached_tokens']:,}   token hit rate "
        f"{_pct(prefix['token_hit_rate'])}   ({prefix['requests_with_hit']:,} requests hit)",
        f"   prefill tokens saved {prefix['prefill_tokens_saved']:,}   evictable blocks at the end "
        f"{prefix['evictable_blocks_end']:,}",
    ]
    if "expected_cached_tokens" in prefix:
        lines.append(f"   turns {prefix['turns']:,}   cached tokens expected from the earlier turns "
                     f"{prefix['expected_cached_tokens']:,}")
    for prompt_id, row in sorted((prefix.get("resident_copies") or {}).items(), key=lambda kv: int(kv[0])):
        hits = "-" if row["peak_copies_among_hits"] is None else row["peak_copies_among_hits"]
        lines.append(f"   prompt {prompt_id}: resident copies peak {row['peak_copies']} (among hits {hits}), mean "
                     f"{row['mean_copies']:.2f}   ({row['requests']} requests, {row['cold_requests']} cold, up to "
                     f"{row['peak_requests']} at once; {row['blocks']} blocks)")
    beam = summary.get("beam")
    if beam:
        over = "the cached prompt" if prefix["caching"] else "the prompt, no caching"
        lines.append(f"   beam over {over}: peak blocks {beam['peak_blocks_used']:,} vs "
                     f"{beam['peak_blocks_no_caching_no_sharing']:,} with neither caching nor sharing "
                     f"(saved {_pct(beam['blocks_saved_at_peak'])})")
    return lines


def render_events(summary: dict[str, Any]) -> list[str]:
    ev = summary.get("events")
    if not ev:
        return []
    if not ev.get("available"):
        return ["-" * 78, f" KV events: no subscriber ({ev.get('error', '')})"]
    return [
        "-" * 78,
        f" KV events consumed   {ev['batches']:,} batches ({ev['snapshots']} snapshots), {ev['events']:,} events"
        f"   dropped by the server {ev['num_dropped']:,}" + ("" if ev["caught_up"] else "   [NOT caught up]"),
        f"   blocks sealed (BlockStored) {ev['blocks_stored']:,}   evicted (BlockRemoved) {ev['blocks_removed']:,}"
        f"   cached now {ev['cached_blocks']:,}   evictable peak {ev['peak_blocks_evictable']:,}",
    ]
