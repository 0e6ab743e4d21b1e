"""From raw series to the run's summary: pure functions over NumPy arrays (tested without a server).

Time averages treat a series as a step function (a sample's value holds until the next sample) over the run's
window [t0, t1]: the start signal to the last worker's end.

Naive preallocation: a system without paging reserves max_len tokens for every sequence it admits, so keeping C
requests of w sequences each (w = 1, beam width, or samples) in flight needs C * w * ceil(max_len / block_size)
blocks; at time t it holds num_sequences(t) * ceil(max_len / block_size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

EXTERNAL_FRAGMENTATION_NOTE = (
    "0 by construction: blocks are fixed-size and a sequence needs no two blocks to be adjacent, so every free "
    "block can serve any sequence's next block"
)


def time_weighted_mean(t: Sequence[float], values: Sequence[float], t0: float, t1: float) -> float:
    """Mean over [t0, t1] of the step function that takes values[i] from t[i] until t[i + 1] (0 before t[0])."""
    t = np.asarray(t, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if t1 <= t0 or t.size == 0:
        return float(v[-1]) if v.size else 0.0
    edges = np.clip(np.append(t, t1), t0, t1)
    return float(np.sum(v * np.diff(edges)) / (t1 - t0))


def merge_step_series(series: Sequence[tuple[Sequence[float], Sequence[float]]]) -> tuple[np.ndarray, np.ndarray]:
    """Sum several step functions (each (t, values), 0 before its first sample) into one, at every change time."""
    times, deltas = [], []
    for t, v in series:
        v = np.asarray(v, dtype=np.float64)
        if v.size == 0:
            continue
        times.append(np.asarray(t, dtype=np.float64))
        deltas.append(np.diff(v, prepend=0.0))
    if not times:
        return np.zeros(0), np.zeros(0)
    t_all = np.concatenate(times)
    d_all = np.concatenate(deltas)
    order = np.argsort(t_all, kind="stable")
    return t_all[order], np.cumsum(d_all[order])


def latency_summary(samples_s: Sequence[float]) -> dict[str, float]:
    x = np.asarray(samples_s, dtype=np.float64) * 1e3
    if x.size == 0:
        return {"count": 0, "p50_ms": 0.0, "p99_ms": 0.0, "mean_ms": 0.0, "max_ms": 0.0}
    return {
        "count": int(x.size),
        "p50_ms": float(np.percentile(x, 50)),
        "p99_ms": float(np.percentile(x, 99)),
        "mean_ms": float(x.mean()),
        "max_ms": float(x.max()),
    }


def saved_fraction(used: float, unshared: float) -> float:
    return 1.0 - used / unshared if unshared > 0 else 0.0


def memory_summary(
    stats: dict[str, Sequence[float]],
    *,
    t0: float,
    t1: float,
    num_blocks: int,
    block_size: int,
    block_bytes: int,
    naive_blocks_per_seq: int,
    naive_peak_seqs: int,
    sequences: dict[str, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """Utilization and fragmentation from the Stats sampler's series; the naive comparison from ``sequences``
    (t, seqs, tokens: the workers' records summed, taken between steps, so a beam forked but not yet replaced
    does not count) when given, else from the sampler's."""
    t = np.asarray(stats["t"], dtype=np.float64)
    used = np.asarray(stats["used"], dtype=np.float64)
    unused = np.asarray(stats["unused"], dtype=np.float64)
    tokens = np.asarray(stats["tokens"], dtype=np.float64)
    seqs = np.asarray(stats["seqs"], dtype=np.float64)
    in_window = (t >= t0) & (t <= t1)
    peak_i = int(np.argmax(np.where(in_window, used, -1))) if used.size else 0
    peak_used = float(used[peak_i]) if used.size else 0.0
    used_slots = used * block_size
    stored = used_slots - unused  # tokens physically held (a shared token once)
    t_seq, tokens_seq = t, tokens
    if sequences is not None:
        t_seq = np.asarray(sequences["t"], dtype=np.float64)
        seqs = np.asarray(sequences["seqs"], dtype=np.float64)
        tokens_seq = np.asarray(sequences["tokens"], dtype=np.float64)
    naive_blocks = seqs * naive_blocks_per_seq
    in_window_seq = (t_seq >= t0) & (t_seq <= t1)

    def avg(values: np.ndarray) -> float:
        return time_weighted_mean(t, values, t0, t1)

    avg_used_slots = avg(used_slots)
    avg_naive_slots = time_weighted_mean(t_seq, naive_blocks * block_size, t0, t1)
    avg_tokens_seq = time_weighted_mean(t_seq, tokens_seq, t0, t1)
    naive_peak_blocks = naive_peak_seqs * naive_blocks_per_seq
    return {
        "pool_blocks": num_blocks,
        "block_bytes": block_bytes,
        "peak_used_blocks": int(peak_used),
        "peak_used_bytes": int(peak_used * block_bytes),
        "peak_utilization": peak_used / num_blocks if num_blocks else 0.0,
        "avg_used_blocks": avg(used),
        "avg_utilization": avg(used) / num_blocks if num_blocks else 0.0,
        "internal_fragmentation_at_peak": float(unused[peak_i] / used_slots[peak_i]) if peak_used else 0.0,
        "internal_fragmentation_avg": avg(unused) / avg_used_slots if avg_used_slots else 0.0,
        "external_fragmentation": 0.0,
        "external_fragmentation_note": EXTERNAL_FRAGMENTATION_NOTE,
        "naive_blocks_per_seq": naive_blocks_per_seq,
        "naive_peak_blocks": naive_peak_blocks,
        "naive_peak_bytes": naive_peak_blocks * block_bytes,
        "naive_observed_peak_blocks": int(naive_blocks[in_window_seq].max()) if in_window_seq.any() else 0,
        "paged_over_naive_peak": peak_used / naive_peak_blocks if naive_peak_blocks else 0.0,
        "kv_used_for_tokens_paged": avg(stored) / avg_used_slots if avg_used_slots else 0.0,
        "kv_used_for_tokens_naive": avg_tokens_seq / avg_naive_slots if avg_naive_slots else 0.0,
        "num_samples": int(in_window.sum()),
    }


def sharing_summary(worker_series: Sequence[dict[str, Sequence[float]]], t0: float, t1: float) -> dict[str, Any]:
    """Blocks saved by sharing, from the workers' exact records: held blocks against sum(ceil(len / block_size))."""
    t_used, used = merge_step_series([(s["t"], s["used"]) for s in worker_series])
    t_logical, logical = merge_step_series([(s["t"], s["logical"]) for s in worker_series])
    avg_used = time_weighted_mean(t_used, used, t0, t1)
    avg_logical = time_weighted_mean(t_logical, logical, t0, t1)
    peak_used = float(used.max()) if used.size else 0.0
    peak_logical = float(logical.max()) if logical.size else 0.0
    return {
        "avg_blocks_with_sharing": avg_used,
        "avg_blocks_without_sharing": avg_logical,
        "blocks_saved_avg": saved_fraction(avg_used, avg_logical),
        "peak_blocks_with_sharing": int(peak_used),
        "peak_blocks_without_sharing": int(peak_logical),
        "blocks_saved_at_peak": saved_fraction(peak_used, peak_logical),
    }


def with_server_usage(share: dict[str, Any], mem: dict[str, Any]) -> dict[str, Any]:
    """``share`` with the blocks held taken from the server's Stats samples instead of the workers' records: with
    prefix caching a cached block is held by requests of several processes, and each worker would count it."""
    avg_used, peak_used = mem["avg_used_blocks"], mem["peak_used_blocks"]
    return {**share, "avg_blocks_with_sharing": avg_used, "peak_blocks_with_sharing": int(peak_used),
            "blocks_saved_avg": saved_fraction(avg_used, share["avg_blocks_without_sharing"]),
            "blocks_saved_at_peak": saved_fraction(peak_used, share["peak_blocks_without_sharing"]),
            "blocks_with_sharing_from": "server stats"}


def downsample(series: dict[str, Sequence[float]], t0: float, max_points: int = 2000) -> dict[str, list[float]]:
    """A JSON-friendly copy: time relative to t0, at most ``max_points`` evenly picked samples."""
    n = len(series["t"])
    pick = np.unique(np.linspace(0, n - 1, min(n, max_points)).astype(int)) if n else np.zeros(0, dtype=int)
    out = {key: [float(np.asarray(v)[i]) for i in pick] for key, v in series.items() if key != "t"}
    out["t"] = [round(float(series["t"][i]) - t0, 6) for i in pick]
    return out
