"""Start-up and shutdown: graceful SIGTERM/SIGINT under load, in-flight calls finishing, the pool released,
a second server on a taken address failing loudly, ``python -m kvpool_server``, flags and environment."""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.config import ServerConfig
from kvpool_server.grpc_api.server import build_server
from kvpool_server.main import shutdown
from kvpool_server import gc_policy
from tests.conftest import server_command, start_server, wait_serving
from tests.service.service_helpers import connect


def hammer(address: str, stop: threading.Event, outcomes: list, num_seqs: int = 64) -> None:
    """Back-to-back AppendToken of ``num_seqs`` sequences; records (time, code) of every call until stopped."""
    with connect(address) as stub:
        seq_ids = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(num_seqs)]
        request = pb.AppendTokenRequest(seq_ids=seq_ids)
        length = 0
        while not stop.is_set():
            try:
                if length == 256:
                    stub.Free(pb.FreeRequest(seq_ids=seq_ids), timeout=10)
                    seq_ids = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(num_seqs)]
                    request = pb.AppendTokenRequest(seq_ids=seq_ids)
                    length = 0
                reply = stub.AppendToken(request, timeout=10)
                assert len(reply.slot_mapping) == num_seqs
                length += 1
                outcomes.append((time.monotonic(), grpc.StatusCode.OK))
            except grpc.RpcError as exc:
                outcomes.append((time.monotonic(), exc.code()))
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    return


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_under_load_drains_and_exits_0(server_factory, sig: int) -> None:
    server = server_factory("--num-blocks", "8192", "--max-seq-len", "512", "--shutdown-grace-s", "10")
    with connect(server.address) as stub:
        shm_name = stub.DescribePool(pb.DescribePoolRequest()).shm_name
    assert os.path.exists(f"/dev/shm/{shm_name}")
    stop = threading.Event()
    outcomes: list[list] = [[] for _ in range(4)]
    threads = [threading.Thread(target=hammer, args=(server.address, stop, out)) for out in outcomes]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while min(len(o) for o in outcomes) < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    signalled_at = time.monotonic()
    assert server.stop(sig) == 0, server.log()
    stop.set()
    for t in threads:
        t.join(30)
    every = [x for out in outcomes for x in out]
    assert sum(code == grpc.StatusCode.OK for _, code in every) >= 200
    failures = [(t - signalled_at, code) for t, code in every if code != grpc.StatusCode.OK]
    assert all(code == grpc.StatusCode.UNAVAILABLE and dt >= 0 for dt, code in failures), failures
    assert not os.path.exists(f"/dev/shm/{shm_name}"), "the pool's shared memory outlived the server"
    assert "shutting down" in server.log() and "stopped" in server.log()


def test_in_flight_calls_finish_new_calls_refused_health_not_serving() -> None:
    """In-process, to hold calls in flight for sure: the test pins the sequences (as a big WriteKV copy in flight
    does), so Frees of them wait inside the server -- without blocking its event loop."""
    config = ServerConfig(address="127.0.0.1:0", backend="host", num_blocks=64, shutdown_grace_s=20).validate()
    handle = build_server(config)
    handle.start()
    address = f"127.0.0.1:{handle.port}"
    pins, loop = handle.service.pins, handle.loop.loop
    try:
        with connect(address) as stub, grpc.insecure_channel(address) as health_channel:
            seq_ids = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(3)]
            watch = health_pb2_grpc.HealthStub(health_channel).Watch(
                health_pb2.HealthCheckRequest(service="kvpool.v1.KVPoolService")
            )
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            for s in seq_ids:
                loop.call_soon_threadsafe(pins.pin, s)
            in_flight = [stub.Free.future(pb.FreeRequest(seq_ids=[s]), timeout=30) for s in seq_ids]
            time.sleep(0.5)  # they reach the servicer and wait for the pins
            assert not any(f.done() for f in in_flight) and handle.admission.num_in_flight == 3
            stopper = threading.Thread(target=shutdown, args=(handle, config.shutdown_grace_s))
            stopper.start()
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            time.sleep(0.3)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Stats(pb.StatsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not handle.pool.closed and not any(f.done() for f in in_flight)
            for s in seq_ids:  # unpinned: the in-flight calls complete, then the pool is closed
                loop.call_soon_threadsafe(pins.unpin, s)
            for f in in_flight:
                assert f.result().num_blocks_freed == 0
            stopper.join(30)
            assert not stopper.is_alive() and handle.pool.closed
    finally:
        handle.stop()
        handle.pool.close()


def run_server(*args: str, timeout: float = 20, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        server_command() + ["--backend", "host", "--num-blocks", "16", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


def test_second_server_on_the_same_port_fails_loudly(server) -> None:
    second = run_server("--address", f"127.0.0.1:{server.port}")
    assert second.returncode != 0
    assert "cannot listen on 127.0.0.1:" in second.stderr and "is in use" in second.stderr, second.stderr
    wait_serving(server.address, server.proc, timeout=5)  # the first one is unharmed


def test_second_server_on_the_same_unix_socket_fails_loudly(unix_server) -> None:
    path = unix_server.address[len("unix:"):]
    second = run_server("--address", "", "--unix-socket", path)
    assert second.returncode != 0
    assert "another server is listening there" in second.stderr, second.stderr
    wait_serving(unix_server.address, unix_server.proc, timeout=5)


def test_python_dash_m_runs_the_same_server(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool_server", "--backend", "host", "--num-blocks", "16",
         "--address", "127.0.0.1:0", "--port-file", str(port_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not (port_file.exists() and port_file.read_text().strip()) and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.05)
        address = f"127.0.0.1:{int(port_file.read_text())}"
        wait_serving(address, proc)
        with connect(address) as stub:
            assert stub.DescribePool(pb.DescribePoolRequest()).server_pid == proc.pid
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--backend", "tpu"], {}, "invalid choice"),
        (["--num-layers", "0"], {}, "--num-layers must be >= 1"),
        (["--pool-bytes", "1MiB"], {}, "give one of"),  # with the --num-blocks every run_server passes
        (["--address", "localhost"], {}, "HOST:PORT"),
        (["--address", ""], {}, "nothing to listen on"),
        ([], {"KVPOOL_MAX_BATCH": "many"}, "KVPOOL_MAX_BATCH"),
        ([], {"KVPOOL_LOG_LEVEL": "LOUD"}, "--log-level"),
    ],
)
def test_bad_configuration_exits_2_with_a_message(args: list[str], env: dict, message: str) -> None:
    result = run_server(*args, env=env)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_gpu_backend_without_a_gpu_exits_1_with_a_message() -> None:
    from kvpool_server.device import gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    result = run_server("--backend", "gpu", "--address", "127.0.0.1:0")
    assert result.returncode == 1 and "cannot create the gpu pool" in result.stderr, result.stderr


def test_environment_configures_and_flags_override(server_factory) -> None:
    server = server_factory("--num-blocks", "48", env={"KVPOOL_BLOCK_SIZE": "8", "KVPOOL_NUM_LAYERS": "2",
                                                        "KVPOOL_DTYPE": "float16", "KVPOOL_NUM_BLOCKS": "999"})
    with connect(server.address) as stub:
        layout = stub.DescribePool(pb.DescribePoolRequest()).layout
    assert (layout.num_blocks, layout.block_size, layout.num_layers, layout.dtype) == (48, 8, 2, pb.DTYPE_FLOAT16)
    assert layout.token_bytes == 2 * 2 * 1 * 64 * 2


def test_gc_policy_freezes_the_live_objects_out_of_collection() -> None:
    try:
        assert gc.get_freeze_count() == 0
        num_frozen = gc_policy.apply()
        # At least the modules' objects; other threads of the test process may free some frozen ones meanwhile.
        assert num_frozen > 1000 and gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()


def test_server_freezes_its_startup_heap(server) -> None:
    deadline = time.monotonic() + 10
    match = None
    while match is None and time.monotonic() < deadline:
        match = re.search(r"(\d+) start-up objects frozen out of garbage collection", server.log_path.read_text())
        time.sleep(0.05)
    assert match is not None and int(match.group(1)) > 1000


def test_cpu_affinity_pins_every_server_thread(tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    server = start_server(tmp_path, "--cpu-affinity", str(cpu))
    try:
        with connect(server.address) as stub:  # a call, so that the worker threads exist
            stub.Stats(pb.StatsRequest())
        masks = {}
        for tid in os.listdir(f"/proc/{server.pid}/task"):
            try:
                masks[tid] = os.sched_getaffinity(int(tid))
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
        assert len(masks) > 2
        assert all(mask == {cpu} for mask in masks.values()), masks
    finally:
        assert server.stop() == 0
