"""Resident copies of each shared prompt: how many physical copies of its blocks live requests hold at once. Pure.

Each shared-prefix request reports one *hold*: (from, until, prompt id, the physical block ids of the prompt's full
blocks, in order, read from its page table after the prefill; how many of them it found cached). ``from`` is taken before it registered and
``until`` after its Free returned, so a hold covers at least the time the request held the blocks: the copies below
can only be overstated, never understated (a reported 1 is exact).

    block position j:      0    1    2   ...        copies of the prompt at time t
    request A holds       17   18   19                = max over j of the number of distinct block ids
    request B holds       17   18   19                  held at position j by the requests live at t
    request C holds       40   41   42                = 2 here (A and B share; C computed its own)

With prefix caching every request after the first finds the sealed blocks and holds the same ones: 1 copy. Without
it (``--no-prefix-cache``), as many copies as requests of that prompt in flight. A prompt's blocks are matchable only
once its first request has sealed them, so the requests that start together at the beginning all miss and compute
their own copies (*cold* requests: fewer blocks cached than the prompt has); ``peak_copies_among_hits`` counts
only the requests that found the whole prompt cached (1 when they all share one copy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from kvpool_client.loadgen.metrics import time_weighted_mean

# (held from, held until, prompt id, physical block ids, how many of them were found cached)
Hold = tuple[float, float, int, Sequence[int], int]


def copies_over_time(holds: Iterable[Hold]) -> dict[int, dict[str, list[float]]]:
    """Per prompt id, step series ``t``, ``copies`` (distinct physical copies held) and ``requests`` (live holds)
    at every change. At equal times, acquisitions count before releases (the overstating side)."""
    by_prompt: dict[int, list[tuple[float, int, Sequence[int]]]] = {}
    for start, stop, prompt_id, block_ids, _ in holds:
        events = by_prompt.setdefault(prompt_id, [])
        events += [(start, 0, block_ids), (stop, 1, block_ids)]
    out: dict[int, dict[str, list[float]]] = {}
    for prompt_id, events in sorted(by_prompt.items()):
        events.sort(key=lambda e: (e[0], e[1]))
        holders: list[Counter[int]] = []  # per block position: physical block id -> live requests holding it
        live = 0
        series: dict[str, list[float]] = {"t": [], "copies": [], "requests": []}
        for t, release, block_ids in events:
            while len(holders) < len(block_ids):
                holders.append(Counter())
            for position, block_id in enumerate(block_ids):
                counter = holders[position]
                if release:
                    counter[block_id] -= 1
                    if counter[block_id] == 0:
                        del counter[block_id]
                else:
                    counter[block_id] += 1
            live += -1 if release else 1
            series["t"].append(t)
            series["copies"].append(max((len(c) for c in holders), default=0))
            series["requests"].append(live)
        out[prompt_id] = series
    return out


def resident_copies_summary(holds: Iterable[Hold], t0: float, t1: float) -> dict[str, dict[str, Any]]:
    """Per prompt id (as a string, for the JSON): peak and mean resident copies -- the mean over the time some
    request held the prompt -- the peak among the requests that found it all cached (None: no such request), the
    most requests of that prompt in flight at once, the requests, the cold ones, and the prompt's blocks."""
    holds = list(holds)
    num_blocks = {h[2]: len(h[3]) for h in holds}
    out: dict[str, dict[str, Any]] = {}
    for prompt_id, s in copies_over_time(holds).items():
        held = [1.0 if c > 0 else 0.0 for c in s["copies"]]
        held_time = time_weighted_mean(s["t"], held, t0, t1)
        mine = [h for h in holds if h[2] == prompt_id]
        hits = [h for h in mine if h[4] >= len(h[3])]
        hit_copies = copies_over_time(hits).get(prompt_id, {}).get("copies", [])
        out[str(prompt_id)] = {
            "peak_copies": int(max(s["copies"], default=0)),
            "peak_copies_among_hits": int(max(hit_copies)) if hit_copies else None,
            "cold_requests": len(mine) - len(hits),
            "mean_copies": time_weighted_mean(s["t"], s["copies"], t0, t1) / held_time if held_time else 0.0,
            "peak_requests": int(max(s["requests"], default=0)),
            "requests": len(mine),
            "blocks": num_blocks[prompt_id],
        }
    return out
