"""The run's summary (every field: docs/loadgen.md), made from what the processes reported (processes.py), what
the run was set up with, and the server's state at the end."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpool_client.loadgen import metrics
from kvpool_client.loadgen import prefix_summary as prefix
from kvpool_client.loadgen import tenants as tenancy
from kvpool_client.loadgen.processes import Collected
from kvpool_client.loadgen.workload import LengthDistribution
from kvpool_client.types import PoolDescription, PoolStats


@dataclass
class RunSetup:
    """What the run was set up with, before any process started."""

    tenants: list[tuple[str, str]]  # (tenant, token) of --token-file, one a process in turn; [] without tenants
    main_token: str | None
    desc: PoolDescription
    before: PoolStats
    dist: LengthDistribution
    width: int  # sequences a request
    seq_max_len: int  # the longest sequence a request can reach
    num_procs: int


@dataclass
class EndState:
    """The server after the run: its stats, and CheckInvariants (not ``checked`` when the token may not call it)."""

    after: PoolStats
    invariants_ok: bool
    invariants_error: str
    checked: bool


def summarize(a: argparse.Namespace, setup: RunSetup, collected: Collected, end: EndState) -> dict[str, Any]:
    """The summary dict; ``ok`` is True when every request completed and verified, no process failed and the
    server's invariants hold."""
    results, sampler, t0 = collected.results, collected.sampler, collected.t0
    desc, layout, before, after = setup.desc, setup.desc.layout, setup.before, end.after
    width, seq_max_len, num_procs, tenants = setup.width, setup.seq_max_len, setup.num_procs, setup.tenants
    worker_errors, failed = collected.worker_errors, collected.failed
    invariants_ok, invariants_error, invariants_checked = end.invariants_ok, end.invariants_error, end.checked
    workers = [results[i] for i in sorted(results)]
    t1 = max((w["t_end"] for w in workers), default=time.monotonic())
    counts = _sum_counts(w["counts"] for w in workers)
    latency: dict[str, list[float]] = {}
    for w in workers:
        for name, samples in w["latency"].items():
            latency.setdefault(name, []).extend(samples)

    naive_seqs = a.concurrency * width
    bs = layout.block_size
    worker_series = [w["series"] for w in workers]
    t_seqs, live_seqs = metrics.merge_step_series([(s["t"], s["seqs"]) for s in worker_series])
    _, live_tokens = metrics.merge_step_series([(s["t"], s["tokens"]) for s in worker_series])
    sequences = {"t": t_seqs, "seqs": live_seqs, "tokens": live_tokens}  # the same change times, in the same order
    mem = metrics.memory_summary(sampler.series, t0=t0, t1=t1, num_blocks=desc.num_blocks, block_size=bs,
                                 block_bytes=desc.block_bytes, naive_blocks_per_seq=-(-seq_max_len // bs),
                                 naive_peak_seqs=naive_seqs, sequences=sequences)
    share = metrics.sharing_summary(worker_series, t0, t1)
    if a.workload != "standard" and not a.no_prefix_cache:  # cached blocks are held across processes
        share = metrics.with_server_usage(share, mem)
    share.update(forks=counts.get("forks", 0), copies=counts.get("copies", 0),
                 copies_server=after.num_copies - before.num_copies,
                 peak_blocks_shared=int(max(sampler.series["shared"], default=0)))
    t_unshared, unshared = metrics.merge_step_series([(w["series"]["t"], w["series"]["logical"]) for w in workers])
    verification_errors = counts.get("verify_errors", 0)
    summary: dict[str, Any] = {
        "config": {
            **{k: v for k, v in vars(a).items() if k not in ("json", "plot", "no_progress", "token", "admin_token",
                                                       "tls")},
            "max_len": seq_max_len, "processes": num_procs, "backend": desc.backend, "layout": asdict(layout),
            "block_size": bs, "token_bytes": layout.token_bytes, "naive_seqs": naive_seqs,
            "sequences_per_request": width,
        },
        "workload": prefix.workload_means(a, setup.dist, collected.claimed if collected.interrupted else None),
        "run": {
            "wall_s": t1 - t0,
            "completions": counts.get("completions", 0),
            "sequences": counts.get("sequences", 0),
            "tokens_appended": counts.get("tokens_appended", 0),
            "tokens_per_s": counts.get("tokens_appended", 0) / (t1 - t0) if t1 > t0 else 0.0,
            "append_calls": counts.get("append_calls", 0),
            "fast_path_appends": counts.get("fast_path_appends", 0),  # of them, over the shared-memory channel
            "decode_steps": counts.get("decode_steps", 0),
            "beams_pruned": counts.get("beams_pruned", 0),
            "resource_exhausted_retries": counts.get("exhausted_retries", 0),
            "prefill_deferrals": counts.get("prefill_deferrals", 0),
            "preemptions": counts.get("preemptions", 0),
            "quota_refusals": counts.get("quota_refusals", 0),
            "stats_samples": len(sampler.series["t"]),
        },
        "verification": {
            "method": ("ReadKV (the pool is not mapped: KV over gRPC)" if collected.kv_paths and all(
                p["kv_path"] == "grpc" for p in collected.kv_paths.values()) else
                {"both": "page table + attached pool, and ReadKV", "table": "page table + attached pool",
                 "readkv": "ReadKV"}[a.verify]),
            "tokens_verified": counts.get("tokens_verified", 0),
            "errors": verification_errors,
            "checks_failed": counts.get("checks_failed", 0),
            "errors_injected": counts.get("errors_injected", 0),
            "messages": [m for w in workers for m in w["errors"]][:10],
        },
        "memory": mem,
        "sharing": share,
        "latency": {name: metrics.latency_summary(latency.get(name, [])) for name in
                    ("append_decode", "append_prefill", "register", "fork", "free", "block_table", "read_kv",
                     "write_slots", "prefix_blocks")},
        "end": {"blocks_used": after.num_blocks_used, "blocks_free": after.num_blocks_free,
                "blocks_total": after.num_blocks_total, "sequences": after.num_sequences,
                "blocks_evictable": after.num_blocks_evictable,
                "invariants_ok": invariants_ok, "invariants_error": invariants_error,
                "invariants_checked": invariants_checked},
        "tenants": tenancy.tenant_summary(sampler.tenant_series, sampler.quotas, workers + list(failed.values()),
                                          t0, t1, [tenancy.worker_token(tenants, i, None)[0] for i in range(num_procs)]),
        "worker_errors": worker_errors,
        "series": {
            "stats": metrics.downsample(sampler.series, t0),
            "unshared": _thin(t_unshared - t0, blocks=unshared),
            "sequences": _thin(t_seqs - t0, seqs=live_seqs, tokens=live_tokens),
            "tenants": {name: metrics.downsample(series, t0) for name, series in sampler.tenant_series.items()},
        },
    }
    if a.workload != "standard":
        summary["prefix"] = prefix.prefix_section(a, counts, workers, t0, t1, after.num_blocks_evictable)
    if a.workload == "shared-prefix" and a.mode == "beam":
        summary["beam"] = prefix.beam_section(mem, share)
    summary["events"] = prefix.events_section(collected.events_seen, sampler.series)
    summary["kv_path"] = kv_path_section(collected.kv_paths)
    summary["interrupted"] = collected.interrupted or None  # "SIGINT" / "SIGTERM": the run was stopped early
    summary["run"]["stopped_in_flight"] = counts.get("stopped_in_flight", 0)
    summary["ok"] = bool(
        verification_errors == 0 and not worker_errors and invariants_ok
        and summary["run"]["completions"] == a.completions and not collected.interrupted
    )
    return summary


def kv_path_section(kv_paths: dict[int, dict[str, str]]) -> dict[str, Any]:
    """How the processes moved KV: ``path`` "attach" (the mapped pool), "grpc" (WriteKV/ReadKV) or "mixed", and
    why gRPC where it was used."""
    paths = {p["kv_path"] for p in kv_paths.values()} or {"attach"}
    whys = sorted({p["why"] for p in kv_paths.values() if p.get("why")})
    return {"path": paths.pop() if len(paths) == 1 else "mixed", "why": whys,
            "grpc_processes": sum(p["kv_path"] == "grpc" for p in kv_paths.values())}


def _thin(t: np.ndarray, max_points: int = 4000, **columns: np.ndarray) -> dict[str, list[float]]:
    """A step series for the JSON: at most ``max_points`` evenly picked change points."""
    pick = np.unique(np.linspace(0, t.size - 1, min(t.size, max_points)).astype(int)) if t.size else t.astype(int)
    return {"t": t[pick].round(6).tolist(), **{k: v[pick].tolist() for k, v in columns.items()}}


def _sum_counts(dicts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total
