"""The servers of benchmarks/bench_service.py, each run as its own process (see that script's docstring).

``Server(kind, extra_args, transport)`` starts one and waits until it takes calls; ``.address`` is the gRPC target
(``127.0.0.1:PORT`` or ``unix:PATH``). The in-script servers (echo, echo-aio, kvpool-inproc) run this file:
``python bench_service_servers.py --kind KIND (--port-file FILE | --unix-socket PATH) [-- kvpool-server flags]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from kvpool.v1 import kvpool_pb2 as pb

ECHO_METHOD = "/kvpool.bench.Echo/Echo"
ECHO_STREAM_METHOD = "/kvpool.bench.Echo/EchoStream"  # the sync echo only: bidi, one echo per request
SERVER_ARGS = ["--backend", "host", "--head-dim", "1", "--num-blocks", str(1 << 19), "--max-seq-len", "8192"]


def _echo(request: pb.AppendTokenRequest, context: object) -> pb.AppendTokenResponse:
    return pb.AppendTokenResponse(slot_mapping=request.seq_ids)


def _echo_stream(requests, context):  # type: ignore[no-untyped-def]
    for request in requests:
        yield pb.AppendTokenStreamResponse(slot_mapping=request.seq_ids)


def _echo_handler(stream: bool = False) -> grpc.GenericRpcHandler:
    methods = {
        "Echo": grpc.unary_unary_rpc_method_handler(
            _echo,
            request_deserializer=pb.AppendTokenRequest.FromString,
            response_serializer=pb.AppendTokenResponse.SerializeToString,
        )
    }
    if stream:
        methods["EchoStream"] = grpc.stream_stream_rpc_method_handler(
            _echo_stream,
            request_deserializer=pb.AppendTokenStreamRequest.FromString,
            response_serializer=pb.AppendTokenStreamResponse.SerializeToString,
        )
    return grpc.method_handlers_generic_handler("kvpool.bench.Echo", methods)


async def _echo_stream_aio(request_iterator, context):  # type: ignore[no-untyped-def]
    async for request in request_iterator:
        yield pb.AppendTokenStreamResponse(slot_mapping=request.seq_ids)


def _echo_handler_aio() -> grpc.GenericRpcHandler:
    """The echo on grpc.aio: the same unary Echo (a plain function works there too) and an async EchoStream."""
    return grpc.method_handlers_generic_handler("kvpool.bench.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(
            _echo,
            request_deserializer=pb.AppendTokenRequest.FromString,
            response_serializer=pb.AppendTokenResponse.SerializeToString,
        ),
        "EchoStream": grpc.stream_stream_rpc_method_handler(
            _echo_stream_aio,
            request_deserializer=pb.AppendTokenStreamRequest.FromString,
            response_serializer=pb.AppendTokenStreamResponse.SerializeToString,
        ),
    })


def listen_args(port_file: str | None, unix_socket: str | None) -> list[str]:
    """kvpool-server flags: only the unix socket (``--address ""``: no TCP), or a free TCP port -> ``port_file``."""
    if unix_socket:
        return ["--address", "", "--unix-socket", unix_socket]
    return ["--address", "127.0.0.1:0", "--port-file", port_file]


def serve(kind: str, port_file: str | None, unix_socket: str | None, extra_args: list[str]) -> None:
    """Run one benchmark server (echo, echo-aio, kvpool-inproc) on a free port or a unix socket until SIGTERM. The
    kvpool kind is made by kvpool_server.grpc_api.server, as the real server's is."""
    from kvpool_server.config import load_config
    from kvpool_server.grpc_api.server import build_server, grpc_options

    config = load_config([*SERVER_ARGS, *extra_args, *listen_args(port_file, unix_socket)])
    options = grpc_options(config)
    address = f"unix:{unix_socket}" if unix_socket else config.address

    def ready(port: int) -> None:  # unix: the parent waits on the socket itself
        if port_file:
            Path(port_file).write_text(str(port))

    if kind == "kvpool-inproc":  # the real server, started in-process without main.serve()'s signals and GC freeze
        handle = build_server(config)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        handle.start()
        ready(handle.port or 0)
        signal.sigwait({signal.SIGTERM})
        handle.stop()
        handle.pool.close()
        return
    if kind == "echo":
        from concurrent import futures

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_workers), options=options)
        server.add_generic_rpc_handlers((_echo_handler(stream=True),))
        port = server.add_insecure_port(address)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        server.start()
        ready(port)
        signal.sigwait({signal.SIGTERM})
        server.stop(0)
        return

    async def run_aio() -> None:
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((_echo_handler_aio(),))
        port = server.add_insecure_port(address)
        await server.start()
        ready(port)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(0)

    asyncio.run(run_aio())


class Server:
    def __init__(self, kind: str, extra_args: list[str], transport: str = "tcp") -> None:
        self.kind = kind
        # A fresh short dir under /tmp for the port file or the socket (a socket path is at most 107 bytes).
        self.tmpdir = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
        unix_socket = os.path.join(self.tmpdir, "s.sock") if transport == "unix" else None
        port_file = None if unix_socket else os.path.join(self.tmpdir, "port")
        listen = listen_args(port_file, unix_socket)
        env = None
        if kind in ("kvpool", "kvpool-before"):
            script = Path(sys.executable).with_name("kvpool-server")
            cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvpool_server"]
            if os.environ.get("PROFILE_DIR"):  # the server's threads under cProfile (profile_server_threads.py)
                cmd = [sys.executable, str(Path(__file__).with_name("profile_server_threads.py"))]  # + the flags below
            cmd += [*SERVER_ARGS, *extra_args, *listen, "--log-level", "WARNING"]
            if kind == "kvpool-before":  # an older tree's server and stubs (bench_service.py --before DIR)
                before = os.environ["KVPOOL_BENCH_BEFORE"]
                path = ":".join(p for p in (f"{before}/server", f"{before}/common", os.environ.get("PYTHONPATH")) if p)
                env = {**os.environ, "PYTHONPATH": path}
        else:
            cmd = [sys.executable, __file__, "--kind", kind, *listen[2:], "--", *extra_args]
        # KVPOOL_BENCH_SERVER_CPUS="0": pin every server to those CPUs (bench_service.py --pin sets it), so that
        # server and client do not share a core by chance; a 2-core machine otherwise swings by +-100 us a step.
        cpus = os.environ.get("KVPOOL_BENCH_SERVER_CPUS")
        preexec = (lambda: os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})) if cpus else None
        self.proc = subprocess.Popen(cmd, preexec_fn=preexec, env=env)
        try:
            self._wait_ready(kind, port_file, unix_socket)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, kind: str, port_file: str | None, unix_socket: str | None) -> None:
        deadline = time.monotonic() + 30
        while not (os.path.exists(unix_socket) if unix_socket else _read(port_file).isdigit()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} server did not start")
            time.sleep(0.02)
        self.address = f"unix:{unix_socket}" if unix_socket else f"127.0.0.1:{_read(port_file)}"
        with grpc.insecure_channel(self.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            if kind in ("kvpool", "kvpool-before"):  # the real server: health SERVING (TCP: already so when the port file appears)
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    raise RuntimeError(f"{kind} server not serving: {reply}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except FileNotFoundError:
        return ""


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", choices=("echo", "echo-aio", "kvpool-inproc"), required=True)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port-file")
    where.add_argument("--unix-socket")
    parser.add_argument("server_args", nargs="*", help="after --: extra kvpool-server flags")
    args = parser.parse_args()
    serve(args.kind, args.port_file, args.unix_socket, args.server_args)
