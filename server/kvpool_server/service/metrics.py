"""Prometheus metrics of one kvpool-server (``--metrics-address HOST:PORT``; every name is listed in docs/metrics.md).

Two kinds, on a registry of their own (never prometheus_client's global one, so two servers in one process -- the
tests -- do not collide):

- the pool's state, read from the manager when Prometheus scrapes (``PoolCollector``): blocks, usage, sequences,
  tokens, fragmentation, sharing, copy-on-write copies, sessions. Nothing is kept in step with the manager, so
  these can never drift from ``Stats``;
- what happened, counted as it happens: RPC latency by method and status code, appends, forks, quota refusals (the
  call handlers, handlers.py and streams.py, report them), session reclamations (the session sweep).

Wiring: ``grpc_server.build_server`` (``--metrics-address`` is in config.py; docs/metrics.md).
"""

from __future__ import annotations

import errno
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool_server.core.pool_figures import POOL_FIGURES
from kvpool_server.core.types import PoolStats
from kvpool_server.offload.tier_pool import CopyTotals
from kvpool_server.offload.host_tier import HostTier
from kvpool_server.offload.metrics import tier_families
from kvpool_server.offload.stats import with_tier
from kvpool_server.figure_family import figure_family

KVPOOL_SERVICE = "kvpool.v1.KVPoolService"
# RPC latency buckets: 50 us .. 10 s. A decode step over a unix socket takes ~0.1-1 ms; a big ReadKV, tens of ms.
RPC_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
# A stream's life (AppendTokenStream, KeepAlive, SubscribeEvents): 10 ms .. 1 day; its own histogram, so that
# minutes-long streams do not sit among the unary calls' milliseconds.
STREAM_BUCKETS = (0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)
# Reclamation latency (a session's end -> its blocks back on the free list): the sweep runs every few 100 ms.
RECLAIM_BUCKETS = (1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Why a session ended, as label values; SessionTable's end_reason strings map onto these.
RECLAIM_REASONS = ("closed", "lease_expired", "stream_broken", "server_shutdown")
_REASON_WORDS = {"close": "closed", "expire": "lease_expired", "lease": "lease_expired", "stream": "stream_broken",
                 "keep-alive": "stream_broken", "keepalive": "stream_broken", "shutdown": "server_shutdown"}


@dataclass(frozen=True)
class SessionGauges:
    """The sessions' state at scrape time. ``num_blocks_held_by_ended`` counts blocks still referenced by sequences
    of sessions that have ended: reclamation frees them in the same sweep, so it must read 0."""

    num_live: int
    num_blocks_held_by_ended: int
    # (tenant name, blocks its sequences hold, its live sequences) for every tenant, with --auth-tokens
    tenants: tuple[tuple[str, int, int], ...] = ()


def build_info() -> dict[str, str]:
    """kvpool_build_info's labels: the server's version, Python's, gRPC's."""
    import platform  # noqa: PLC0415
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "unknown"

    return {"version": of("kvpool"), "python": platform.python_version(), "grpcio": of("grpcio")}


def locked_stats(manager: Any, lock: threading.Lock, tier: HostTier | None = None) -> Callable[[], PoolStats]:
    """A stats reader for ``watch_pool`` that takes the servicer's lock, so a scrape never sees half a call (with
    the host tier's fields, given its bookkeeping ``tier``)."""

    def read() -> PoolStats:
        with lock:
            return with_tier(manager.stats(), tier)

    return read


def reason_label(reason: str) -> str:
    """A reclamation reason as a label value: one of RECLAIM_REASONS when the words say which, else a slug."""
    text = reason.strip().lower()
    if text in RECLAIM_REASONS:
        return text
    for word, label in _REASON_WORDS.items():
        if word in text:
            return label
    return re.sub(r"[^a-z0-9]+", "_", text).strip("_") or "unknown"


class PoolCollector(Collector):
    """The pool's gauges, computed from ``read_stats()`` (and ``read_sessions()``) at every scrape."""

    def __init__(self, read_stats: Callable[[], PoolStats], read_sessions: Callable[[], SessionGauges] | None = None,
                 *, block_bytes: int | None = None,
                 read_tier_copies: Callable[[], CopyTotals | None] | None = None) -> None:
        self.read_stats = read_stats
        self.read_sessions = read_sessions
        self.block_bytes = block_bytes
        self.read_tier_copies = read_tier_copies

    def describe(self) -> Iterable[Metric]:
        return self._families(None, None)

    def collect(self) -> Iterable[Metric]:
        sessions = self.read_sessions() if self.read_sessions is not None else SessionGauges(0, 0)
        copies = self.read_tier_copies() if self.read_tier_copies is not None else None
        return self._families(self.read_stats(), sessions, copies or CopyTotals())

    def _families(self, s: PoolStats | None, sessions: SessionGauges | None,
                  copies: CopyTotals | None = None) -> list[Metric]:
        """Every family; without ``s`` (describe) they carry no samples."""

        def pool(value: Callable[[PoolStats], float]) -> float | None:
            return None if s is None else value(s)

        def sess(value: Callable[[SessionGauges], float]) -> float | None:
            return None if sessions is None else value(sessions)

        def copied(value: Callable[[CopyTotals], float]) -> float | None:
            return None if copies is None else value(copies)

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        families: list[Metric] = [
            *(figure_family(f, pool(attrgetter(f.name))) for f in POOL_FIGURES),
            *tier_families(pool, copied, self.block_bytes),
            gauge("kvpool_sessions", "Live sessions", sess(lambda g: g.num_live)),
            gauge("kvpool_ended_session_blocks", "Blocks still held by sequences of ended sessions (must be 0)",
                  sess(lambda g: g.num_blocks_held_by_ended)),
        ]
        tenant_blocks = GaugeMetricFamily("kvpool_tenant_blocks_used", "Blocks a tenant's sequences hold (with "
                                          "--auth-tokens; docs/security.md says how shared blocks count)",
                                          labels=["tenant"])
        tenant_sequences = GaugeMetricFamily("kvpool_tenant_sequences", "A tenant's live sequences", labels=["tenant"])
        for name, num_blocks, num_sequences in (sessions.tenants if sessions is not None else ()):
            tenant_blocks.add_metric([name], num_blocks)
            tenant_sequences.add_metric([name], num_sequences)
        families += [tenant_blocks, tenant_sequences]
        block_bytes = self.block_bytes
        if block_bytes is not None:
            families += [
                gauge("kvpool_block_size_bytes", "Bytes of one block", pool(lambda s: block_bytes)),
                gauge("kvpool_pool_size_bytes", "Bytes of the whole pool",
                      pool(lambda s: s.num_blocks_total * block_bytes)),
                gauge("kvpool_used_bytes", "Bytes of the used blocks", pool(lambda s: s.num_blocks_used * block_bytes)),
            ]
        return families


class KVPoolMetrics:
    """The server's metrics: a registry, the event counters and histograms, and (after ``watch_pool``) the pool."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rpc_duration = Histogram("kvpool_rpc_duration_seconds", "Time to serve a unary RPC",
                                      ["method", "code"], buckets=RPC_BUCKETS, registry=r)
        self.stream_duration = Histogram("kvpool_stream_duration_seconds", "A stream's life, from its start to "
                                         "its end (CANCELLED: the client ended it)", ["method", "code"],
                                         buckets=STREAM_BUCKETS, registry=r)
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, open fds, start time
        PlatformCollector(registry=r)  # python_info
        Info("kvpool_build", "The server's version and what it runs on (value 1)", registry=r).info(build_info())
        self.append_calls = Counter("kvpool_append_calls", "AppendToken calls and AppendTokenStream messages served",
                                    registry=r)
        self.forks = Counter("kvpool_forks", "Fork calls served", registry=r)
        self.fork_children = Counter("kvpool_fork_children", "Sequences created by Fork", registry=r)
        self.sessions_reclaimed = Counter("kvpool_sessions_reclaimed", "Sessions ended and their sequences freed",
                                          ["reason"], registry=r)
        self.reclaimed_sequences = Counter("kvpool_session_reclaimed_sequences",
                                           "Sequences freed by session reclamation", registry=r)
        self.reclaimed_blocks = Counter("kvpool_session_reclaimed_blocks",
                                        "Blocks returned to the free list by session reclamation", registry=r)
        self.reclaim_duration = Histogram("kvpool_session_reclaim_duration_seconds",
                                          "From a session's end (lease deadline, stream break, close) to its blocks "
                                          "being free", ["reason"], buckets=RECLAIM_BUCKETS, registry=r)
        for reason in RECLAIM_REASONS:  # every reason's series exists from the start, at 0
            self.sessions_reclaimed.labels(reason)
            self.reclaim_duration.labels(reason)
        self.quota_refusals = Counter("kvpool_quota_refusals", "Requests refused by a tenant's quota, by tenant and "
                                      "quota (max_blocks, max_sequences, max_sessions, reserved)",
                                      ["tenant", "quota"], registry=r)
        self.pool_collector: PoolCollector | None = None
        # (stream, method, code name) -> its histogram's child: ``labels()`` looks its labels up and validates them
        # (~0.6 us), once per series here. Bounded: the RPC names and the status codes are fixed sets.
        self._rpc_series: dict[tuple[bool, str, str], Any] = {}

    def watch_pool(self, read_stats: Callable[[], PoolStats], read_sessions: Callable[[], SessionGauges] | None = None,
                   *, block_bytes: int | None = None,
                   read_tier_copies: Callable[[], CopyTotals | None] | None = None) -> PoolCollector:
        """Export the pool's gauges, read at scrape time from ``read_stats()`` (e.g. ``locked_stats(...)``);
        ``read_tier_copies``: the host tier's copy totals (``KVPoolService.tier_copies``)."""
        if self.pool_collector is not None:
            raise ValueError("watch_pool() was already called on these metrics")
        self.pool_collector = PoolCollector(read_stats, read_sessions, block_bytes=block_bytes,
                                            read_tier_copies=read_tier_copies)
        self.registry.register(self.pool_collector)
        return self.pool_collector

    # ------------------------------------------------------------------ hooks
    def observe_rpc(self, method: str, code_name: str, seconds: float, *, stream: bool = False) -> None:
        """One RPC served: ``method`` "AppendToken", ``code_name`` "OK" / "NOT_FOUND" / ..., wall seconds;
        ``stream``: a whole stream ended (its life goes to kvpool_stream_duration_seconds)."""
        key = (stream, method, code_name)
        series = self._rpc_series.get(key)
        if series is None:
            series = self._rpc_series[key] = (self.stream_duration if stream else self.rpc_duration).labels(
                method, code_name)
        series.observe(seconds)

    def count_append(self, num_calls: int) -> None:
        """``num_calls`` AppendToken calls (or stream messages), applied (their tokens: the core's count,
        ``num_tokens_appended``, a pool figure)."""
        self.append_calls.inc(num_calls)

    def quota_refused(self, tenant: str, message: str) -> None:
        """A request refused by a quota; ``message`` names it (``... quota max_blocks=8 ...``)."""
        found = re.search(r"quota (\w+)=", message)
        quota = found.group(1) if found else ("reserved" if "reserv" in message else "other")
        self.quota_refusals.labels(tenant, quota).inc()

    def count_fork(self, num_children: int) -> None:
        """One Fork that created ``num_children`` sequences."""
        self.forks.inc()
        self.fork_children.inc(num_children)

    def session_reclaimed(self, reason: str, latency_s: float, num_sequences: int = 0, num_blocks: int = 0) -> None:
        """A session ended and its sequences were freed. Call it from the reclamation sweep (and CloseSession, with
        reason "closed"): ``latency_s`` from the moment the session ended (its lease deadline, the stream break, the
        close request) to its blocks being free; ``num_blocks`` as Free reports them (ref count reached 0)."""
        label = reason_label(reason)
        self.sessions_reclaimed.labels(label).inc()
        self.reclaim_duration.labels(label).observe(max(0.0, latency_s))
        self.reclaimed_sequences.inc(num_sequences)
        self.reclaimed_blocks.inc(num_blocks)

    def metric_names(self) -> set[str]:
        """Every sample name this registry exposes (``_bucket``/``_count``/``_sum``/``_total`` included)."""
        return {sample.name for family in self.registry.collect() for sample in family.samples}


class MetricsHTTPServer:
    """``start_metrics_server``'s result: where it listens, and ``close()``."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host, self.port = server.server_address[:2]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def start_metrics_server(address: str, registry: CollectorRegistry) -> MetricsHTTPServer:
    """Serve ``registry`` in Prometheus text format at http://ADDRESS/metrics from a daemon thread (port 0: any free
    port; ``.port`` says which). Raises OSError naming the address when it cannot listen."""
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit():
        raise ValueError(f"metrics address must be HOST:PORT, got {address!r}")
    try:
        server, thread = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0", registry=registry)
    except OSError as exc:
        hint = {errno.EADDRINUSE: ": another process listens there", errno.EADDRNOTAVAIL: ": not an address of "
                "this host"}.get(exc.errno or 0, "")
        raise OSError(exc.errno, f"cannot serve metrics on {address}: {exc.strerror}{hint}") from exc
    server.set_app(_only_metrics(server.get_app()))  # prometheus_client's own app answers every path
    return MetricsHTTPServer(server, thread)


METRICS_PATHS = ("/metrics", "/metrics/")


def _only_metrics(app: Any) -> Any:
    """The exposition at /metrics only; any other path is 404 naming /metrics (a scraper or a person pointed at
    the wrong path learns it, rather than getting the metrics from anywhere)."""

    def serve(environ: dict, start_response: Any) -> Any:
        if environ.get("PATH_INFO", "") in METRICS_PATHS:
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"kvpool-server: not found; the Prometheus metrics are at /metrics\n"]

    return serve
