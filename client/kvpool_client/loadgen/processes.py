"""The load generator's worker processes: ``spawn`` them (one ``WorkerConfig`` each), then ``collect`` what they
report -- readiness, each completion (the progress bar), each process's result or error -- while a ``StatsSampler``
and an ``EventCounter`` watch the server, until every process has reported or died.

SIGINT or SIGTERM during the run (``Interrupt``): the first sets the ``stop`` event -- each worker ends its loop
after the call in hand, reports what it did, and closes its client, whose session's end frees the sequences it had in
flight -- and the driver collects those reports for up to ``STOP_GRACE_S`` (then terminates the rest) and
summarizes what was done; a second signal stops at once (KeyboardInterrupt, no summary). Workers ignore SIGINT (a
Ctrl-C reaches the whole process group): the driver decides. A worker whose driver is gone stops by itself.

Messages on the events queue are ``(kind, worker_id, payload, extra)``: ``ready`` (payload: how the process
moves KV, ``{"kv_path": "attach" | "grpc", "why": ...}``); ``done`` (extra: the process's
tokens appended so far); ``result`` (payload: ``Worker.summary()``); ``error`` (payload: the traceback, extra: the
counts so far, for the per-tenant figures).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvpool_client.loadgen import tenants as tenancy
from kvpool_client.loadgen.dashboard import ProgressBar
from kvpool_client.loadgen.event_counter import EventCounter
from kvpool_client.loadgen.sampler import StatsSampler
from kvpool_client.loadgen.worker import worker_main
from kvpool_client.loadgen.worker_config import WorkerConfig
from kvpool_client.loadgen.workload import LengthDistribution

READY_TIMEOUT_S = 120.0
DEAD_GRACE_S = 2.0  # a process that exited without a message: its last message may still be in the queue
JOIN_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0  # after a SIGINT: how long the workers have to report before they are terminated


@dataclass
class Workers:
    """The spawned processes and what they share: the request counter, the start signal, the events queue."""

    procs: list[Any]
    claim: Any
    start: Any
    events: Any
    stop: Any  # set by the driver's first SIGINT / SIGTERM: every worker stops and reports


@dataclass
class Collected:
    """What the processes reported, and what was watched on the server meanwhile."""

    t0: float
    results: dict[int, dict[str, Any]] = field(default_factory=dict)  # worker id -> Worker.summary()
    failed: dict[int, dict[str, Any]] = field(default_factory=dict)  # what a worker that failed had done
    worker_errors: list[str] = field(default_factory=list)
    sampler: Any = None
    events_seen: dict[str, Any] | None = None
    interrupted: str = ""  # the signal that stopped the run ("SIGINT"), or ""
    claimed: int = 0  # requests the processes started (all of them, unless interrupted)
    kv_paths: dict[int, dict[str, str]] = field(default_factory=dict)  # worker id -> {"kv_path", "why"} (kv_path.py)


class Interrupt:
    """While the run's processes work, SIGINT and SIGTERM ask them to stop instead of raising wherever the driver
    happens to be: the first sets ``stop`` and is remembered; a second raises KeyboardInterrupt (stop at once).
    Handlers are installed only in the main thread (elsewhere signals cannot be handled) and restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, stop: Any) -> None:
        self.stop = stop
        self.name = ""
        self.at = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.name:
            raise KeyboardInterrupt
        self.name, self.at = signal.Signals(signum).name, time.monotonic()
        self.stop.set()

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def spawn(a: argparse.Namespace, tenants: list[tuple[str, str]], dist: LengthDistribution,
          num_procs: int) -> Workers:
    """Start ``num_procs`` processes sharing ``a.concurrency`` requests in flight; they wait for ``start``."""
    shares = [a.concurrency // num_procs + (i < a.concurrency % num_procs) for i in range(num_procs)]
    ctx = mp.get_context("spawn")
    workers = Workers([], ctx.Value("q", 0), ctx.Event(), ctx.Queue(), ctx.Event())
    try:
        for i, share in enumerate(shares):
            tenant, token = tenancy.worker_token(tenants, i, a.token)
            cfg = WorkerConfig(i, a.target, share, a.completions, a.seed, a.lengths, dist.max_len, a.mode,
                               a.beam_width, a.num_samples, a.prune_every, a.verify, a.timeout, a.inject_errors,
                               exhausted_wait_s=a.exhausted_wait, kv_source=a.kv_source, token=token, tenant=tenant,
                               workload=a.workload, num_prompts=a.num_prompts, shared_tokens=a.shared_tokens,
                               unique_tokens=a.unique_tokens, num_turns=a.turns, turn_tokens=a.turn_tokens,
                               no_prefix_cache=a.no_prefix_cache, credentials=a.tls, kv_path=a.kv_path,
                               fast_path=not a.no_fast_path)
            proc = ctx.Process(target=worker_main, name=f"kvpool-loadgen-{i}",
                               args=(cfg, workers.claim, workers.start, workers.events, workers.stop))
            workers.procs.append(proc)
            # born with SIGINT blocked: a Ctrl-C while it imports is not its to handle (worker_main ignores SIGINT
            # and unblocks it); the driver's own pending SIGINT arrives when the mask is restored
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    except BaseException:  # Ctrl-C while starting them: stop those started (Python's exit would wait for them)
        _stop_now(workers)
        raise
    return workers


def _stop_now(workers: Workers) -> None:
    workers.stop.set()
    workers.start.set()
    for proc in workers.procs:
        if proc.pid is not None:  # started
            proc.terminate()
            proc.join()


def collect(a: argparse.Namespace, workers: Workers, tenants: list[tuple[str, str]], main_token: str | None
            ) -> Collected:
    """Wait for every process to be ready, start them, and gather their reports; the processes are joined (or
    terminated after ``JOIN_TIMEOUT_S``, or ``STOP_GRACE_S`` after a SIGINT) and the watchers stopped however this
    ends. A first SIGINT / SIGTERM stops the workers and ends the collection with what they report (``Interrupt``)."""
    with Interrupt(workers.stop) as interrupt:
        out = _collect(a, workers, tenants, main_token, interrupt)
    out.interrupted = interrupt.name
    out.claimed = min(workers.claim.value, a.completions)
    return out


def _collect(a: argparse.Namespace, workers: Workers, tenants: list[tuple[str, str]], main_token: str | None,
             interrupt: Interrupt) -> Collected:
    procs, events = workers.procs, workers.events
    out = Collected(t0=time.monotonic())
    event_counter = None
    try:
        ready = _wait_ready(events, procs, out, interrupt)
        stats_tokens = [a.admin_token] if a.admin_token else [t for _, t in tenants] or [a.token]
        out.sampler = StatsSampler(a.target, a.sample_interval_ms / 1e3, tokens=stats_tokens,
                                   tenants=[name for name, _ in tenants], credentials=a.tls).start()
        event_counter = EventCounter(a.target, main_token, credentials=a.tls).start()
        out.t0 = time.monotonic()
        if ready:
            workers.start.set()
        bar = ProgressBar(a.completions, enabled=False if a.no_progress else None)
        done = 0
        tokens_by_worker: dict[int, int] = {}
        dead_since: dict[int, float] = {}
        while ready and len(out.results) + len(out.worker_errors) < len(procs):
            if interrupt.name and time.monotonic() - interrupt.at > STOP_GRACE_S:
                out.worker_errors.append(f"{len(procs) - len(out.results)} worker(s) did not report within "
                                         f"{STOP_GRACE_S:g} s of {interrupt.name}: terminated")
                break
            try:
                kind, wid, payload, extra = events.get(timeout=0.5)
            except queue.Empty:
                _check_alive(procs, out.results, out.worker_errors, dead_since)
                continue
            if kind == "done":
                done += 1
                tokens_by_worker[wid] = extra
                bar.update(done, sum(tokens_by_worker.values()))
            elif kind == "result":
                out.results[wid] = payload
            elif kind == "error":
                out.worker_errors.append(f"worker {wid}: {payload}")
                if extra is not None:
                    out.failed[wid] = extra
        bar.close()
    finally:
        workers.start.set()
        join_s = min(JOIN_TIMEOUT_S, 2.0) if interrupt.name else JOIN_TIMEOUT_S
        for proc in procs:
            proc.join(timeout=join_s)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        if out.sampler is not None:
            out.sampler.stop()
        out.events_seen = event_counter.stop() if event_counter is not None else None
    return out


def _wait_ready(events: Any, procs: list, out: Collected, interrupt: Interrupt) -> bool:
    """Every process attached (or chose gRPC for KV: ``out.kv_paths``) and said ready; False if one failed."""
    worker_errors = out.worker_errors
    ready: set[int] = set()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while len(ready) < len(procs):
        if interrupt.name:
            return False
        try:
            kind, wid, payload, _ = events.get(timeout=min(0.5, max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() < deadline:
                continue
            worker_errors.append(f"workers not ready after {READY_TIMEOUT_S}s")
            return False
        if kind == "ready":
            ready.add(wid)
            out.kv_paths[wid] = payload or {"kv_path": "attach", "why": ""}
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
        if now - dead_since.setdefault(i, now) > DEAD_GRACE_S:
            worker_errors.append(f"worker {i}: exited with {proc.exitcode} without a result")
