"""kvpool service benchmark: one decode step of 256 sequences as a single AppendToken call, over gRPC.

Every server is a separate process started by this script, one at a time:

  echo           a bare sync gRPC server whose one method returns the 256 request ids as 256 int64s
                 (AppendTokenRequest in, AppendTokenResponse out: the same message shapes as a decode step)
  kvpool         the real ``kvpool-server`` console script (sync gRPC, host backend)
  echo-aio       the echo on grpc.aio
  kvpool-aio     the kvpool servicer on grpc.aio (no thread pool; the same core, pool and servicer logic)

For each: one client doing back-to-back steps (steps/s, p50, p99 latency), then ``--clients`` client processes at
once (aggregate steps/s). For kvpool also the naive way: one unary AppendToken per sequence per step.
Run: ``.venv/bin/python benchmarks/bench_service.py`` (``make bench-service``); ``--quick`` for a short run.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

NUM_SEQS = 256
# A decode step's cost does not depend on the KV size, so the pool has tiny tokens (head_dim 1: 8 bytes) and room
# for 8192 steps of 1024 sequences: no client has to free and re-register (256 extra calls) during a measurement.
RESET_EVERY = 8000  # steps; then every sequence is freed and re-registered (untimed)
ECHO_METHOD = "/kvpool.bench.Echo/Echo"
SERVER_ARGS = ["--backend", "host", "--head-dim", "1", "--num-blocks", str(1 << 19), "--max-seq-len", "8192"]


# ------------------------------------------------------------------------------------------------ servers
def _echo(request: pb.AppendTokenRequest, context: object) -> pb.AppendTokenResponse:
    return pb.AppendTokenResponse(slot_mapping=request.seq_ids)


def _echo_handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "kvpool.bench.Echo",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(
                _echo,
                request_deserializer=pb.AppendTokenRequest.FromString,
                response_serializer=pb.AppendTokenResponse.SerializeToString,
            )
        },
    )


def _async_kvpool_servicer(servicer):  # type: ignore[no-untyped-def]
    """The sync servicer's methods as coroutines (errors via ``await context.abort``)."""
    from kvpool_server.core import KVPoolError
    from kvpool_server.errors import status_of

    class AsyncServicer(pb_grpc.KVPoolServiceServicer):
        pass

    def wrap(method):  # type: ignore[no-untyped-def]
        inner = method.__wrapped__

        async def call(self, request, context):  # type: ignore[no-untyped-def]
            try:
                return inner(servicer, request, context)
            except KVPoolError as exc:
                await context.abort(*status_of(exc))

        return call

    for name in pb.DESCRIPTOR.services_by_name["KVPoolService"].methods_by_name:
        setattr(AsyncServicer, name, wrap(getattr(type(servicer), name)))
    return AsyncServicer()


def serve(kind: str, port_file: str, extra_args: list[str]) -> None:
    """Run one benchmark server (echo, echo-aio, kvpool-aio) on a free port until SIGTERM."""
    from kvpool_server.config import load_config
    from kvpool_server.main import grpc_options

    config = load_config([*SERVER_ARGS, *extra_args, "--address", "127.0.0.1:0"])
    options = grpc_options(config)
    if kind == "echo":
        from concurrent import futures

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_workers), options=options)
        server.add_generic_rpc_handlers((_echo_handler(),))
        port = server.add_insecure_port(config.address)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        server.start()
        Path(port_file).write_text(str(port))
        signal.sigwait({signal.SIGTERM})
        server.stop(0)
        return

    async def run_aio() -> None:
        server = grpc.aio.server(options=options)
        pool = None
        if kind == "echo-aio":
            server.add_generic_rpc_handlers((_echo_handler(),))
        else:
            from kvpool_server.core import KVCacheManager
            from kvpool_server.device import create_pool
            from kvpool_server.service import KVPoolServicer

            pool = create_pool(config.layout, backend=config.backend, **config.pool_size_kwargs())
            manager = KVCacheManager(pool.num_blocks, config.block_size, max_seq_len=config.max_seq_len)
            servicer = KVPoolServicer(
                manager, pool, max_batch=config.max_batch, max_message_bytes=config.max_message_bytes
            )
            pb_grpc.add_KVPoolServiceServicer_to_server(_async_kvpool_servicer(servicer), server)
        port = server.add_insecure_port(config.address)
        await server.start()
        Path(port_file).write_text(str(port))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(0)
        if pool is not None:
            pool.close()

    asyncio.run(run_aio())


class Server:
    def __init__(self, kind: str, extra_args: list[str]) -> None:
        self.kind = kind
        fd, self.port_file = tempfile.mkstemp(prefix="bench-port-")
        os.close(fd)
        if kind == "kvpool":
            script = Path(sys.executable).with_name("kvpool-server")
            cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvpool_server"]
            cmd += [*SERVER_ARGS, *extra_args, "--address", "127.0.0.1:0", "--port-file", self.port_file,
                    "--log-level", "WARNING"]
        else:
            cmd = [sys.executable, __file__, "--serve", kind, "--port-file", self.port_file, "--", *extra_args]
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 30
        while not Path(self.port_file).read_text().strip().isdigit():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} server did not start")
            time.sleep(0.02)
        self.address = f"127.0.0.1:{Path(self.port_file).read_text().strip()}"
        grpc.channel_ready_future(grpc.insecure_channel(self.address)).result(timeout=30)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        os.unlink(self.port_file)


# ------------------------------------------------------------------------------------------------ clients
def run_client(kind: str, address: str, mode: str, duration_s: float, start_at: float | None = None) -> list[float]:
    """Back-to-back steps for ``duration_s``; returns each step's latency in seconds."""
    channel = grpc.insecure_channel(address)
    if kind.startswith("echo"):
        echo = channel.unary_unary(
            ECHO_METHOD,
            request_serializer=pb.AppendTokenRequest.SerializeToString,
            response_deserializer=pb.AppendTokenResponse.FromString,
        )
        request = pb.AppendTokenRequest(seq_ids=range(1, NUM_SEQS + 1))

        def step() -> None:
            assert len(echo(request).slot_mapping) == NUM_SEQS

        reset = None
    else:
        stub = pb_grpc.KVPoolServiceStub(channel)
        state: dict = {}

        def reset() -> None:
            if "ids" in state:
                stub.Free(pb.FreeRequest(seq_ids=state["ids"]))
            state["ids"] = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(NUM_SEQS)]
            state["batch"] = pb.AppendTokenRequest(seq_ids=state["ids"])
            state["singles"] = [pb.AppendTokenRequest(seq_ids=[s]) for s in state["ids"]]

        reset()
        if mode == "batched":

            def step() -> None:
                assert len(stub.AppendToken(state["batch"]).slot_mapping) == NUM_SEQS

        else:

            def step() -> None:
                for single in state["singles"]:
                    stub.AppendToken(single)

    for i in range(50):  # warm up
        step()
        if reset is not None and i == 49:
            reset()
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    latencies: list[float] = []
    steps_since_reset = 0
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        step()
        latencies.append(time.perf_counter() - t0)
        steps_since_reset += 1
        if reset is not None and steps_since_reset == RESET_EVERY:
            reset()
            steps_since_reset = 0
    channel.close()
    return latencies


def _client_proc(args: tuple) -> tuple[int, float]:
    latencies = run_client(*args)
    return len(latencies), sum(latencies)


def summarize(latencies: list[float]) -> dict[str, float]:
    lat = np.array(latencies)
    return {
        "steps_per_s": len(lat) / lat.sum(),
        "p50_us": float(np.percentile(lat, 50) * 1e6),
        "p99_us": float(np.percentile(lat, 99) * 1e6),
    }


def measure(
    kind: str, duration_s: float, clients: int, naive: bool, extra_args: list[str]
) -> dict[str, dict[str, float]]:
    server = Server(kind, extra_args)
    try:
        results = {"1 client": summarize(run_client(kind, server.address, "batched", duration_s))}
        if clients > 1:
            ctx = mp.get_context("spawn")
            start_at = time.time() + 3.0  # after every client process has imported and warmed up
            with ctx.Pool(clients) as workers:
                per_client = workers.map(
                    _client_proc, [(kind, server.address, "batched", duration_s, start_at)] * clients
                )
            results[f"{clients} clients"] = {"steps_per_s": sum(n / t for n, t in per_client)}
        if naive:
            results["naive 1 client"] = summarize(run_client(kind, server.address, "naive", duration_s))
    finally:
        server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", choices=("echo", "echo-aio", "kvpool-aio"), help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per measurement")
    parser.add_argument("--clients", type=int, default=2, help="client processes for the concurrent figure")
    parser.add_argument("--rounds", type=int, default=2, help="alternate echo/kvpool this many times")
    parser.add_argument("--no-aio", action="store_true", help="skip the asyncio variants")
    parser.add_argument("--no-naive", action="store_true", help="skip the one-call-per-sequence figure")
    parser.add_argument("--quick", action="store_true", help="1 s per measurement, 1 round")
    parser.add_argument("--kinds", default="echo,kvpool,echo-aio,kvpool-aio", help="servers to measure")
    parser.add_argument("server_args", nargs="*", help="after --: extra kvpool-server flags for every server")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port_file, args.server_args)
        return
    if args.quick:
        args.duration, args.rounds = 1.0, 1
    kinds = [k for k in args.kinds.split(",") if not (args.no_aio and k.endswith("-aio"))]
    print(f"decode step = AppendToken of {NUM_SEQS} sequences x 1 token; {os.cpu_count()} CPUs; "
          f"{args.duration:.0f} s per figure; {args.rounds} rounds (best and median); server flags {args.server_args}")
    rounds: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for kind in kinds:
            results = measure(kind, args.duration, args.clients, kind == "kvpool" and not args.no_naive, args.server_args)
            for label, figures in results.items():
                rounds.setdefault((kind, label), []).append(figures)
    best = {key: max(runs, key=lambda f: f["steps_per_s"]) for key, runs in rounds.items()}
    median = {key: statistics.median(f["steps_per_s"] for f in runs) for key, runs in rounds.items()}
    print(f"{'server':<12} {'clients':<16} {'steps/s':>9} {'median':>9} {'entries/s':>11} {'p50 us':>8} {'p99 us':>8}")
    for (kind, label), f in best.items():
        p50 = f"{f['p50_us']:8.0f}" if "p50_us" in f else f"{'':8}"
        p99 = f"{f['p99_us']:8.0f}" if "p99_us" in f else f"{'':8}"
        print(f"{kind:<12} {label:<16} {f['steps_per_s']:9.0f} {median[(kind, label)]:9.0f} "
              f"{f['steps_per_s'] * NUM_SEQS:11.0f} {p50} {p99}")
    print("ratios of best (median) steps/s:")
    for pair in (("kvpool", "echo"), ("kvpool-aio", "echo-aio"), ("kvpool-aio", "kvpool")):
        for label in ("1 client", f"{args.clients} clients"):
            a, b = (pair[0], label), (pair[1], label)
            if a in best and b in best:
                print(f"  {pair[0]} / {pair[1]} ({label}): {best[a]['steps_per_s'] / best[b]['steps_per_s']:.2f} "
                      f"({median[a] / median[b]:.2f})")
    naive, batched = ("kvpool", "naive 1 client"), ("kvpool", "1 client")
    if naive in best and batched in best:
        print(f"  batched / naive (kvpool, 1 client): {best[batched]['steps_per_s'] / best[naive]['steps_per_s']:.0f}x")


if __name__ == "__main__":
    main()
