"""kvpool_server.service.metrics: the Prometheus exposition against the manager's own Stats, in process and over HTTP."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvpool_client import KVPoolClient, NotFoundError  # noqa: E402
from kvpool_client.kvctl import main as kvctl_main  # noqa: E402
from kvpool_server.core import KVCacheManager  # noqa: E402
from kvpool_server.config import ServerConfig  # noqa: E402
from kvpool_server.service.metrics import (  # noqa: E402
    RECLAIM_REASONS,
    KVPoolMetrics,
    SessionGauges,
    locked_stats,
    reason_label,
    start_metrics_server,
)
from kvpool_server.grpc_api.server import build_server  # noqa: E402


def scrape_text(text: str) -> dict[tuple[str, tuple], float]:
    """Exposition text -> {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape_registry(metrics: KVPoolMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in metrics.registry.collect() for s in family.samples}


def known_workload(manager: KVCacheManager) -> None:
    """3 sequences, one forked twice and appended to (copy-on-write), one freed."""
    a, b, c = manager.register(), manager.register(), manager.register()
    manager.append([a, b, c], [5, 16, 1])
    children = manager.fork(a, 2)
    manager.append([a, *children], 1)  # a's last block is shared: 2 copies
    manager.free(c)


def test_gauges_equal_the_managers_stats():
    manager = KVCacheManager(num_blocks=32, block_size=4, max_seq_len=64)
    known_workload(manager)
    metrics = KVPoolMetrics()
    metrics.watch_pool(locked_stats(manager, threading.Lock()), block_bytes=1024)
    got = scrape_registry(metrics)
    s = manager.stats()
    assert s.num_copies == 2 and s.num_blocks_shared > 0  # the workload did what it says
    expected = {
        "kvpool_blocks": s.num_blocks_total, "kvpool_blocks_free": s.num_blocks_free,
        "kvpool_blocks_used": s.num_blocks_used, "kvpool_blocks_shared": s.num_blocks_shared,
        "kvpool_usage_ratio": s.utilization, "kvpool_sequences": s.num_sequences, "kvpool_tokens": s.num_tokens,
        "kvpool_slots_unused": s.num_slots_unused,
        "kvpool_internal_fragmentation_ratio": s.internal_fragmentation, "kvpool_block_size_tokens": 4,
        "kvpool_cow_copies_total": 2, "kvpool_block_size_bytes": 1024, "kvpool_pool_size_bytes": 32 * 1024,
        "kvpool_used_bytes": s.num_blocks_used * 1024, "kvpool_sessions": 0, "kvpool_ended_session_blocks": 0,
    }
    for name, value in expected.items():
        assert got[(name, ())] == pytest.approx(value), name
    # Read at scrape time: the next scrape follows the manager with no call in between.
    manager.free(list(manager.index.seq_ids()))
    got = scrape_registry(metrics)
    assert got[("kvpool_blocks_used", ())] == 0 and got[("kvpool_blocks_free", ())] == 32


def test_event_hooks():
    metrics = KVPoolMetrics()
    metrics.observe_rpc("AppendToken", "OK", 0.0003)
    metrics.observe_rpc("AppendToken", "RESOURCE_EXHAUSTED", 0.002)
    metrics.count_append(3)
    metrics.count_fork(4)
    metrics.session_reclaimed("lease expired", 0.12, num_sequences=2, num_blocks=7)
    metrics.session_reclaimed("keep-alive stream broken", 0.01)
    got = scrape_registry(metrics)
    assert got[("kvpool_rpc_duration_seconds_count", (("code", "OK"), ("method", "AppendToken")))] == 1
    assert got[("kvpool_rpc_duration_seconds_bucket",
                (("code", "OK"), ("le", "0.0005"), ("method", "AppendToken")))] == 1
    assert got[("kvpool_rpc_duration_seconds_count",
                (("code", "RESOURCE_EXHAUSTED"), ("method", "AppendToken")))] == 1
    assert got[("kvpool_append_calls_total", ())] == 3
    assert (got[("kvpool_forks_total", ())], got[("kvpool_fork_children_total", ())]) == (1, 4)
    assert got[("kvpool_sessions_reclaimed_total", (("reason", "lease_expired"),))] == 1
    assert got[("kvpool_sessions_reclaimed_total", (("reason", "stream_broken"),))] == 1
    assert got[("kvpool_sessions_reclaimed_total", (("reason", "closed"),))] == 0  # exists before the first
    assert got[("kvpool_session_reclaim_duration_seconds_sum", (("reason", "lease_expired"),))] == pytest.approx(0.12)
    assert (got[("kvpool_session_reclaimed_sequences_total", ())],
            got[("kvpool_session_reclaimed_blocks_total", ())]) == (2, 7)


def test_sessions_gauges_come_from_the_reader():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    metrics = KVPoolMetrics()
    metrics.watch_pool(manager.stats, lambda: SessionGauges(num_live=3, num_blocks_held_by_ended=0))
    got = scrape_registry(metrics)
    assert (got[("kvpool_sessions", ())], got[("kvpool_ended_session_blocks", ())]) == (3, 0)


@pytest.mark.parametrize("text, label", [("closed", "closed"), ("lease expired", "lease_expired"),
                                         ("keep-alive stream broken", "stream_broken"), ("Odd Reason!", "odd_reason")])
def test_reason_labels(text, label):
    assert reason_label(text) == label
    assert set(RECLAIM_REASONS) >= {"closed", "lease_expired", "stream_broken"}


def test_names_follow_prometheus_conventions():
    metrics = KVPoolMetrics()
    metrics.watch_pool(KVCacheManager(num_blocks=4, block_size=4).stats, block_bytes=64)
    for family in metrics.registry.collect():
        if family.name.startswith(("process_", "python_")):  # prometheus_client's standard process series
            continue
        assert family.name.startswith("kvpool_"), family.name
        if family.type == "counter":
            assert not family.name.endswith("_total")  # the client adds _total to the sample
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        if family.type == "gauge" and "ratio" in family.documentation.lower():
            assert family.name.endswith("_ratio")
    with pytest.raises(ValueError, match="already"):
        metrics.watch_pool(KVCacheManager(num_blocks=4, block_size=4).stats)


@pytest.fixture
def grpc_server_with_metrics(tmp_path):
    """A real server as build_server wires it (the handlers' observe/count calls, watch_pool, the HTTP server)."""
    config = ServerConfig(backend="host", pool_bytes=64 * 8192, address="127.0.0.1:0", metrics_address="127.0.0.1:0")
    handle = build_server(config.validate())
    handle.start()
    yield f"127.0.0.1:{handle.port}", handle.metrics_http, handle.service.guard.manager
    handle.stop()
    handle.pool.close()


def test_http_scrape_after_a_known_workload(grpc_server_with_metrics):
    target, http, manager = grpc_server_with_metrics
    with KVPoolClient(target, session=False) as kv:
        a, b = kv.register(), kv.register()
        kv.append([a, b], [17, 3])
        children = kv.fork(a, 2)
        kv.append([a, *children])
        with kv.append_stream() as stream:
            stream.step([b], 2)
            stream.step([b])
        with pytest.raises(NotFoundError):
            kv.block_table(999)
        stats = kv.stats()
    text = urllib.request.urlopen(http.url, timeout=5).read().decode()
    got = scrape_text(text)
    assert got[("kvpool_blocks_used", ())] == stats.num_blocks_used
    assert got[("kvpool_blocks_shared", ())] == stats.num_blocks_shared
    assert got[("kvpool_tokens", ())] == stats.num_tokens
    assert got[("kvpool_cow_copies_total", ())] == stats.num_copies == 2
    assert got[("kvpool_internal_fragmentation_ratio", ())] == pytest.approx(stats.internal_fragmentation)
    assert got[("kvpool_append_calls_total", ())] == 4  # two unary calls, two stream messages
    assert got[("kvpool_appended_tokens_total", ())] == 20 + 3 + 3
    assert got[("kvpool_forks_total", ())] == 1 and got[("kvpool_fork_children_total", ())] == 2
    ok = (("code", "OK"), ("method", "AppendToken"))
    assert got[("kvpool_rpc_duration_seconds_count", ok)] == 2
    assert got[("kvpool_rpc_duration_seconds_count", (("code", "NOT_FOUND"), ("method", "GetBlockTable")))] == 1
    # a stream's life is its own histogram: no AppendTokenStream among the unary calls' latencies (24.6)
    assert got[("kvpool_stream_duration_seconds_count", (("code", "OK"), ("method", "AppendTokenStream")))] == 1
    assert not [key for key in got if key[0].startswith("kvpool_rpc_duration") and "AppendTokenStream" in str(key)]
    build = next(key for key in got if key[0] == "kvpool_build_info")
    assert dict(build[1])["version"] and got[build] == 1
    assert got[("process_resident_memory_bytes", ())] > 0 and ("process_cpu_seconds_total", ()) in got


def test_a_kvctl_events_exit_is_not_an_error(grpc_server_with_metrics, capsys):
    """kvctl events ends its stream by cancelling it: a stream's CANCELLED, which the documented error-rate query
    (docs/metrics.md) does not count."""
    target, http, _ = grpc_server_with_metrics
    assert kvctl_main(["--target", target, "events", "--batches", "1", "--json"]) == 0
    cancelled = ("kvpool_stream_duration_seconds_count", (("code", "CANCELLED"), ("method", "SubscribeEvents")))
    deadline = time.monotonic() + 10  # the server sees the client's cancel after kvctl returns: it is recorded then
    while True:
        got = scrape_text(urllib.request.urlopen(http.url, timeout=5).read().decode())
        if cancelled in got or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got[cancelled] == 1
    errors = [key for key, value in got.items() if key[0] == "kvpool_rpc_duration_seconds_count" and value
              and dict(key[1])["code"] not in ("OK", "CANCELLED")]
    assert errors == []


def test_metrics_server_reports_a_busy_address(grpc_server_with_metrics):
    _, http, _ = grpc_server_with_metrics
    with pytest.raises(OSError, match="cannot serve metrics on"):
        start_metrics_server(f"127.0.0.1:{http.port}", KVPoolMetrics().registry)


def test_kvpool_server_process_serves_metrics(server_factory, tmp_path):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = server_factory("--metrics-address", f"127.0.0.1:{port}")
    with KVPoolClient(server.address, session=False) as kv:  # its sequences outlive it
        seq = kv.register()
        kv.append([seq], 20)
        stats = kv.stats()
    got = scrape_text(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
    assert got[("kvpool_blocks_used", ())] == stats.num_blocks_used == 2
    assert got[("kvpool_appended_tokens_total", ())] == 20
    assert got[("kvpool_rpc_duration_seconds_count", (("code", "OK"), ("method", "AppendToken")))] == 1


def test_only_metrics_is_served_every_other_path_is_404(grpc_server_with_metrics):
    """Issue 35 item 6: the exposition at /metrics only (prometheus_client's app answers any path)."""
    import urllib.error

    _, http, _ = grpc_server_with_metrics
    assert "kvpool_blocks_used" in urllib.request.urlopen(f"http://127.0.0.1:{http.port}/metrics", timeout=5).read().decode()
    for path in ("/", "/metricsx", "/favicon.ico", "/metrics/../x"):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"http://127.0.0.1:{http.port}{path}", timeout=5)
        assert caught.value.code == 404 and b"/metrics" in caught.value.read()
