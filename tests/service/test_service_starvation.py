"""No client can starve the server (issue #10, part 2-3): idle, stalled and busy streams never hold up Health or
Stats; a stream cap and an idle timeout with clear statuses; a stream's end-of-stream hook runs promptly when its
client dies; CheckInvariants in a loop beside a decode loop leaves the decode loop's p99 bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.config import ServerConfig
from kvpool_server.grpc_api.server import build_server
from tests.service.service_helpers import connect
from tests.service.test_service_stream import Stream

ROOT = Path(__file__).resolve().parents[2]


def load(*args: str) -> subprocess.Popen:
    """tests/service/load_worker.py in its own process; returns once it printed ``ready``."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.service.load_worker", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    assert line.strip() == "ready", f"load worker failed: {line!r}"
    return proc


def latencies(address: str, seconds: float) -> tuple[list[float], list[float]]:
    """Health.Check and Stats, one after the other every 20 ms for ``seconds``: each call's latency."""
    health_s, stats_s = [], []
    with connect(address) as stub:
        health = health_pb2_grpc.HealthStub(stub.channel)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            t1 = time.perf_counter()
            stub.Stats(pb.StatsRequest(), timeout=5)
            t2 = time.perf_counter()
            health_s.append(t1 - t0)
            stats_s.append(t2 - t1)
            time.sleep(0.02)
    return health_s, stats_s


def test_216_streams_idle_stalled_and_busy_never_hold_up_health_or_stats(server_factory) -> None:
    server = server_factory("--num-blocks", "65536", "--head-dim", "1", "--max-seq-len", "2048")
    worker = load("streams", server.address, "200", "8", "8", "6")
    try:
        health_s, stats_s = latencies(server.address, 4.0)
    finally:
        out, _ = worker.communicate(timeout=30)
    worst = max(max(health_s), max(stats_s))
    report = (f"216 streams: Health p50 {np.median(health_s) * 1e3:.1f} ms max {max(health_s) * 1e3:.1f} ms; "
              f"Stats p50 {np.median(stats_s) * 1e3:.1f} ms max {max(stats_s) * 1e3:.1f} ms; {out.strip()}")
    print(report)
    assert "busy steps" in out and int(out.split()[-1]) > 100, out  # the busy streams did work meanwhile
    assert worst < 1.0, report  # starvation is a timeout; 50 ms is the goal on a quiet machine (docs/api.md), and
    # CI shares 2 cores with the 216 streams and the workers driving them


def test_stream_cap_refuses_with_the_flags_name(server_factory) -> None:
    server = server_factory("--max-streams", "3")
    with connect(server.address) as stub:
        seq_id = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        streams = [Stream(stub) for _ in range(3)]
        for s in streams:
            s.send([seq_id])
        extra = Stream(stub)
        with pytest.raises(grpc.RpcError) as info:
            extra.send([seq_id])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-streams=3" in info.value.details()
        assert stub.Stats(pb.StatsRequest()).num_tokens == 3  # unary calls are not streams
        streams[0].close()
        time.sleep(0.2)
        again = Stream(stub)
        assert len(again.send([seq_id]).slot_mapping) == 1


def test_an_idle_stream_is_ended_unavailable(server_factory) -> None:
    server = server_factory("--stream-idle-timeout-s", "0.5")
    with connect(server.address) as stub:
        seq_id = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        stream = Stream(stub)
        stream.send([seq_id])
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            next(stream.responses)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "--stream-idle-timeout-s" in info.value.details()
        assert 0.3 < time.monotonic() - started < 3
        busy = Stream(stub)  # a stream that keeps sending is never idle
        for _ in range(12):
            busy.send([seq_id])
            time.sleep(0.1)


def test_end_of_stream_hook_runs_promptly_when_the_client_is_sigkilled() -> None:
    config = ServerConfig(address="127.0.0.1:0", backend="host", num_blocks=64).validate()
    handle = build_server(config)
    handle.start()
    streams = handle.streams
    closed_at: list[tuple[float, str]] = []
    close = streams.close

    def recording_close(entry, reason):  # type: ignore[no-untyped-def]
        closed_at.append((time.monotonic(), reason))
        close(entry, reason)

    streams.close = recording_close  # type: ignore[method-assign]
    try:
        worker = load("hold-stream", f"127.0.0.1:{handle.port}")
        time.sleep(0.2)
        assert len(streams) == 1 and not closed_at
        killed_at = time.monotonic()
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        deadline = time.monotonic() + 5
        while not closed_at and time.monotonic() < deadline:
            time.sleep(0.005)
        assert closed_at, "the end-of-stream hook did not run"
        delay = closed_at[0][0] - killed_at
        print(f"end-of-stream hook {delay * 1e3:.1f} ms after SIGKILL ({closed_at[0][1]})")
        # 100 ms is the bound the sessions need; generous here, as CI's 2 cores also run the worker
        assert closed_at[0][1] in ("half-closed", "cancelled") and delay < 0.5 and len(streams) == 0
    finally:
        handle.stop()
        handle.pool.close()


def test_check_invariants_in_a_loop_leaves_a_decode_loop_fast(server_factory) -> None:
    server = server_factory("--num-blocks", "262144", "--head-dim", "1", "--max-seq-len", "2048")
    with connect(server.address) as stub:  # half the pool in use: 2048 sequences x 1024 tokens
        filler = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(2048)]
        for start in range(0, 2048, 128):
            stub.AppendToken(pb.AppendTokenRequest(seq_ids=filler[start:start + 128], num_tokens=[1024]))
        assert stub.Stats(pb.StatsRequest()).num_blocks_used == 131072
        seq_ids = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(256)]
        stream = Stream(stub)
        worker = load("check-loop", server.address, "6")
        try:
            step_s = []
            end = time.monotonic() + 4
            while time.monotonic() < end:
                t0 = time.perf_counter()
                stream.send(seq_ids)
                step_s.append(time.perf_counter() - t0)
                if len(step_s) % 1000 == 0:
                    stream.close()
                    stub.Free(pb.FreeRequest(seq_ids=seq_ids))
                    seq_ids = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(256)]
                    stream = Stream(stub)
        finally:
            out, _ = worker.communicate(timeout=30)
    p99 = float(np.percentile(step_s, 99))
    report = (f"decode loop beside CheckInvariants: {len(step_s) / 4:.0f} steps/s, p50 "
              f"{np.median(step_s) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms; {out.strip()}")
    print(report)
    assert int(out.split()[-1]) >= 2, out  # the checks ran
    # Before: one CheckInvariants loop cut such a decode loop to ~23 steps/s. Generous bounds for CI's 2 shared cores.
    assert p99 < 0.1 and len(step_s) > 400, report


_ = (os, threading)
