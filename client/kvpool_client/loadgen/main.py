"""kvpool-loadgen: P client processes keep C requests in flight against a kvpool server until N complete.

    kvpool-loadgen --target unix:/tmp/kvpool.sock                       # the seed's defaults
    kvpool-loadgen --lengths sharegpt --mode beam --beam-width 4 --json out/beam4.json --plot out/beam4.png

Exit status: 0 when every request completed and verified with 0 KV errors and the server's invariants hold;
1 otherwise; 2 for bad arguments or no server.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvpool_client.client import KVPoolClient
from kvpool_client.errors import InternalError, KVPoolClientError
from kvpool_client.loadgen import metrics, preflight
from kvpool_client.loadgen import tenants as tenancy
from kvpool_client.loadgen.args import build_parser, check_args
from kvpool_client.loadgen import prefix_summary as prefix
from kvpool_client.loadgen.dashboard import ProgressBar, render
from kvpool_client.loadgen.event_counter import EventCounter
from kvpool_client.loadgen.sampler import StatsSampler
from kvpool_client.loadgen.worker import worker_main
from kvpool_client.loadgen.worker_config import WorkerConfig
from kvpool_client.loadgen.workload import distribution, sequences_per_request

READY_TIMEOUT_S = 120.0


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Run the load and return the summary (see docs/loadgen.md for every field)."""
    tenants = tenancy.read_token_file(a.token_file, a.tenants) if a.tenants else []
    main_token = a.admin_token or (tenants[0][1] if tenants else a.token)
    with KVPoolClient(a.target, timeout=a.timeout, token=main_token) as client:
        preflight.connect(client, a.target, a.connect_timeout)
        desc = client.describe_pool()
        before = client.stats()
    layout = desc.layout
    dist = distribution(a.lengths, a.max_len)
    width = sequences_per_request(a.mode, a.beam_width, a.num_samples)
    seq_max_len = prefix.longest_sequence(a, dist)  # shared-prefix: the whole prompt + output; chat: the last turn
    fit = preflight.pool_fit(desc.num_blocks, layout.block_size, seq_max_len, width, a.concurrency)
    if not fit.one_fits:
        raise preflight.NoRoomError(preflight.too_small_message(fit, seq_max_len))
    if not fit.all_fit:
        print(f"kvpool-loadgen: warning: {a.concurrency} requests in flight may need up to {fit.blocks_in_flight} "
              f"blocks and the pool has {desc.num_blocks}: expect RESOURCE_EXHAUSTED retries", file=sys.stderr)
    num_procs = min(a.processes, a.concurrency)
    shares = [a.concurrency // num_procs + (i < a.concurrency % num_procs) for i in range(num_procs)]

    ctx = mp.get_context("spawn")
    claim, start, events = ctx.Value("q", 0), ctx.Event(), ctx.Queue()
    procs = []
    for i, share in enumerate(shares):
        tenant, token = tenancy.worker_token(tenants, i, a.token)
        cfg = WorkerConfig(i, a.target, share, a.completions, a.seed, a.lengths, dist.max_len, a.mode, a.beam_width,
                           a.num_samples, a.prune_every, a.verify, a.timeout, a.inject_errors,
                           exhausted_wait_s=a.exhausted_wait, kv_source=a.kv_source, token=token, tenant=tenant,
                           workload=a.workload, num_prompts=a.num_prompts, shared_tokens=a.shared_tokens,
                           unique_tokens=a.unique_tokens, num_turns=a.turns, turn_tokens=a.turn_tokens,
                           no_prefix_cache=a.no_prefix_cache)
        proc = ctx.Process(target=worker_main, args=(cfg, claim, start, events), name=f"kvpool-loadgen-{i}")
        proc.start()
        procs.append(proc)

    results: dict[int, dict[str, Any]] = {}
    failed: dict[int, dict[str, Any]] = {}  # what a worker that failed had done (for the per-tenant counts)
    worker_errors: list[str] = []
    sampler = None
    event_counter = None
    try:
        ready = _wait_ready(events, procs, worker_errors)
        stats_tokens = [a.admin_token] if a.admin_token else [t for _, t in tenants] or [a.token]
        sampler = StatsSampler(a.target, a.sample_interval_ms / 1e3, tokens=stats_tokens,
                               tenants=[name for name, _ in tenants]).start()
        event_counter = EventCounter(a.target, main_token).start()
        t0 = time.monotonic()
        if ready:
            start.set()
        bar = ProgressBar(a.completions, enabled=False if a.no_progress else None)
        done = 0
        tokens_by_worker: dict[int, int] = {}
        dead_since: dict[int, float] = {}
        while ready and len(results) + len(worker_errors) < len(procs):
            try:
                kind, wid, payload, extra = events.get(timeout=0.5)
            except queue.Empty:
                _check_alive(procs, results, worker_errors, dead_since)
                continue
            if kind == "done":
                done += 1
                tokens_by_worker[wid] = extra
                bar.update(done, sum(tokens_by_worker.values()))
            elif kind == "result":
                results[wid] = payload
            elif kind == "error":
                worker_errors.append(f"worker {wid}: {payload}")
                if extra is not None:
                    failed[wid] = extra
        bar.close()
    finally:
        start.set()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        if sampler is not None:
            sampler.stop()
        events_seen = event_counter.stop() if event_counter is not None else None

    with KVPoolClient(a.target, timeout=a.timeout, token=main_token) as client:
        after = client.stats()
        invariants_checked = True
        try:
            client.check_invariants()
            invariants_ok, invariants_error = True, ""
        except InternalError as error:
            invariants_ok, invariants_error = False, str(error)
        except KVPoolClientError as error:  # a frontend token may not call CheckInvariants: not checked
            if error.code is not grpc.StatusCode.PERMISSION_DENIED:
                raise
            invariants_ok, invariants_error, invariants_checked = True, "", False

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
            **{k: v for k, v in vars(a).items() if k not in ("json", "plot", "no_progress", "token", "admin_token")},
            "max_len": seq_max_len, "processes": num_procs, "backend": desc.backend, "layout": asdict(layout),
            "block_size": bs, "token_bytes": layout.token_bytes, "naive_seqs": naive_seqs,
            "sequences_per_request": width,
        },
        "workload": prefix.workload_means(a, dist),
        "run": {
            "wall_s": t1 - t0,
            "completions": counts.get("completions", 0),
            "sequences": counts.get("sequences", 0),
            "tokens_appended": counts.get("tokens_appended", 0),
            "tokens_per_s": counts.get("tokens_appended", 0) / (t1 - t0) if t1 > t0 else 0.0,
            "append_calls": counts.get("append_calls", 0),
            "decode_steps": counts.get("decode_steps", 0),
            "beams_pruned": counts.get("beams_pruned", 0),
            "resource_exhausted_retries": counts.get("exhausted_retries", 0),
            "prefill_deferrals": counts.get("prefill_deferrals", 0),
            "preemptions": counts.get("preemptions", 0),
            "quota_refusals": counts.get("quota_refusals", 0),
            "stats_samples": len(sampler.series["t"]),
        },
        "verification": {
            "method": {"both": "page table + attached pool, and ReadKV", "table": "page table + attached pool",
                       "readkv": "ReadKV"}[a.verify],
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
    summary["events"] = prefix.events_section(events_seen, sampler.series)
    summary["ok"] = bool(
        verification_errors == 0 and not worker_errors and invariants_ok
        and summary["run"]["completions"] == a.completions
    )
    return summary


def _thin(t: np.ndarray, max_points: int = 4000, **columns: np.ndarray) -> dict[str, list[float]]:
    """A step series for the JSON: at most ``max_points`` evenly picked change points."""
    pick = np.unique(np.linspace(0, t.size - 1, min(t.size, max_points)).astype(int)) if t.size else t.astype(int)
    return {"t": t[pick].round(6).tolist(), **{k: v[pick].tolist() for k, v in columns.items()}}


def _wait_ready(events: Any, procs: list, worker_errors: list[str]) -> bool:
    ready: set[int] = set()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while len(ready) < len(procs):
        try:
            kind, wid, payload, _ = events.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            worker_errors.append(f"workers not ready after {READY_TIMEOUT_S}s")
            return False
        if kind == "ready":
            ready.add(wid)
        elif kind == "error":
            worker_errors.append(f"worker {wid}: {payload}")
            return False
    return True


def _check_alive(procs: list, results: dict, worker_errors: list[str], dead_since: dict[int, float]) -> None:
    """A process that died without a result (and without an error message) fails the run, after a grace period
    for its last message to come through the queue."""
    now = time.monotonic()
    for i, proc in enumerate(procs):
        if proc.exitcode is None or i in results or any(e.startswith(f"worker {i}:") for e in worker_errors):
            continue
        if now - dead_since.setdefault(i, now) > 2.0:
            worker_errors.append(f"worker {i}: exited with {proc.exitcode} without a result")


def _sum_counts(dicts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        summary = run(args)
    except (KVPoolClientError, preflight.NoServerError, preflight.NoRoomError, tenancy.TokenFileError) as error:
        print(f"kvpool-loadgen: {error}", file=sys.stderr)
        return 2
    summary["diagnosis"] = preflight.explain_incomplete(summary)
    print(render(summary), flush=True)
    for line in summary["diagnosis"]:
        print(line, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        try:
            from kvpool_client.loadgen.plot import plot_memory  # noqa: PLC0415

            plot_memory(summary, args.plot)
        except ImportError as error:  # matplotlib is the loadgen extra; the run itself does not need it
            print(f"kvpool-loadgen: no plot ({error}); pip install 'kvpool-client[loadgen]'", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
