"""build_server(config): the pool, the core, the service and the grpc.aio server around them (KVPoolService,
health, reflection v1 and v1alpha), bound to its addresses but not started -- ``ServerHandle.start()`` does that
(main.serve, tests, benchmarks). ``service.build.build_service(config, ...)`` is the part without gRPC.

The server runs on an asyncio event loop of its own thread ("kvpool-loop"), so the process's main thread stays free
for signals (main.serve) and synchronous callers (tests, ``main.shutdown``) drive it through ``ServerHandle.run``.
Why asyncio: a stream costs a coroutine, not one of a fixed pool of threads (docs/api.md, "The server's design").
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvpool.v1 import kvpool_pb2
from kvpool_server.config import ServerConfig
from kvpool_server.device.protocol import Pool
from kvpool_server.fastpath.server import FastPathServer
from kvpool_server.grpc_api.handlers import unary_handler
from kvpool_server.grpc_api.listen import bind
from kvpool_server.grpc_api.methods import RPCS, BidiStream, ServerStream, Unary, open_fast_path
from kvpool_server.grpc_api.reflection import SERVICE_NAME, add_reflection
from kvpool_server.grpc_api.streams import OpenStreams, bidi_handler, server_stream_handler
from kvpool_server.service.admission import Admission
from kvpool_server.service.background import BackgroundTasks
from kvpool_server.service.build import StartupError, build_service
from kvpool_server.service.errors import ServerShuttingDownError
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.metrics import KVPoolMetrics, MetricsHTTPServer, locked_stats, start_metrics_server
from kvpool_server.service.scope import CallScope
from kvpool_server.service.sessions import REAP_INTERVAL_S

SERVICE = kvpool_pb2.DESCRIPTOR.services_by_name["KVPoolService"]
T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running in a thread of its own; ``run(coro)`` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvpool-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass
class ServerHandle:
    server: grpc.aio.Server
    port: int | None  # the bound TCP port (None when only a unix socket is used)
    pool: Pool
    service: KVPoolService
    admission: Admission  # the call scope's: shutdown starts it
    health: health.aio.HealthServicer
    loop: LoopThread
    executor: ThreadPoolExecutor  # copy threads (big WriteKV/ReadKV, CheckInvariants, big requests' parsing)
    streams: OpenStreams
    background: BackgroundTasks  # periodic work on the loop: ``handle.background.every(interval_s, fn)``
    metrics: KVPoolMetrics | None = None
    metrics_address: str = ""
    fast_path: FastPathServer | None = None  # the shared-memory channels (None with --no-fast-path)
    metrics_http: MetricsHTTPServer | None = field(default=None)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the server's event loop and wait for its result (from any other thread)."""
        return self.loop.run(coro, timeout)

    def start(self) -> None:
        """Start serving; health says SERVING (for "" and KVPoolService) from now on; metrics over HTTP when
        configured. Raises StartupError if the metrics address cannot be bound."""
        if self.metrics is not None:
            guard = self.service.guard
            tier = self.service.tier.tier if self.service.tier is not None else None
            self.metrics.watch_pool(locked_stats(guard.manager, guard.lock, tier), self.service.sessions.gauges,
                                    block_bytes=self.pool.layout.block_bytes,
                                    read_tier_copies=self.service.tier_copies)
            try:
                self.metrics_http = start_metrics_server(self.metrics_address, self.metrics.registry)
            except OSError as exc:
                raise StartupError(str(exc)) from exc
        self.run(self._start())
        if self.fast_path is not None:
            self.fast_path.start()

    async def _start(self) -> None:
        await self.server.start()
        self.background.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def begin_drain(self) -> None:
        """Shutdown's first step: refuse new calls (admission), health NOT_SERVING, and end every stream waiting
        for its client's next message with UNAVAILABLE."""
        self.admission.start()
        self.run(self._begin_drain())

    async def _begin_drain(self) -> None:
        await self.health.enter_graceful_shutdown()
        self.streams.end_waiting(ServerShuttingDownError("kvpool-server is shutting down and takes no new calls"))

    def stop(self) -> None:
        """Stop at once: cancel every call, stop the loop and the copy threads, close the metrics server (not the
        pool: ``main.shutdown`` closes it under the lock). Idempotent."""
        if not self.loop.loop.is_closed():
            self.run(self._stop())
            self.loop.close()
        if self.fast_path is not None:
            self.fast_path.stop()
        self.executor.shutdown(wait=True, cancel_futures=True)
        if self.metrics_http is not None:
            self.metrics_http.close()
            self.metrics_http = None

    async def _stop(self) -> None:
        await self.background.stop()
        await self.server.stop(0)


def grpc_options(config: ServerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Only the identity "compression": a compressed request is refused (UNIMPLEMENTED) before it is inflated,
        # so 2 MB of gzip on the wire cannot become 64 MiB of server memory.
        ("grpc.compression_enabled_algorithms_bitset", 1),
        # No BDP probing: a stream's receive window stays 64 KiB until its handler asks for the message, so a WriteKV
        # waiting for the byte budget is not received meanwhile (with it, each waiting stream's window grew to MiBs
        # and 16 waiting 64 MiB bodies took ~900 MB; grpc_api/admitted_reads.py).
        ("grpc.http2.bdp_probe", 0),
        # Ping every connection every keepalive_time_s, idle or not; a peer that does not answer within
        # keepalive_timeout_s is gone, and its calls (streams included) are cancelled.
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # clients may ping every 10 s
    ]


def _health_soon(health_servicer: Any, draining: bool) -> None:
    """Health NOT_SERVING (a drain) or SERVING again (its undoing) for everything, from a call on the loop (the
    Drain RPC). After a shutdown began the servicer keeps NOT_SERVING (its graceful shutdown ignores ``set``)."""
    status = health_pb2.HealthCheckResponse.NOT_SERVING if draining else health_pb2.HealthCheckResponse.SERVING
    for service in ("", SERVICE_NAME):
        asyncio.get_running_loop().create_task(health_servicer.set(service, status))


def method_handlers(service: KVPoolService, scope: CallScope, executor: Executor, streams: OpenStreams,
                    fast_path: FastPathServer | None = None) -> dict[str, grpc.RpcMethodHandler]:
    """A raw-bytes handler for every KVPoolService method, chosen by the method's kind (``methods.RPCS``;
    OpenFastPath opens ``fast_path``'s channels, or answers FAILED_PRECONDITION without one)."""
    handlers = {}
    rpcs = {**RPCS, "OpenFastPath": open_fast_path(fast_path)}
    for name, descriptor in SERVICE.methods_by_name.items():
        method = rpcs[name]
        kind = (descriptor.client_streaming, descriptor.server_streaming)
        if kind == (False, False) and isinstance(method, Unary):
            handlers[name] = unary_handler(service, scope, executor, name, method)
        elif kind == (True, True) and isinstance(method, BidiStream):
            handlers[name] = bidi_handler(service, scope, name, method, streams)
        elif kind == (False, True) and isinstance(method, ServerStream):
            handlers[name] = server_stream_handler(service, scope, name, method)
        else:
            raise TypeError(f"{name}: methods.RPCS has a {type(method).__name__} for a method of kind {kind}")
    return handlers


def build_server(config: ServerConfig) -> ServerHandle:
    """``build_service`` plus the grpc.aio server (KVPoolService, health, reflection) on a loop thread, bound to
    ``config``'s addresses, not started. Raises StartupError (with nothing left allocated) if the pool cannot be
    made or an address cannot be bound."""
    health_servicer = health.aio.HealthServicer()
    metrics = KVPoolMetrics() if config.metrics_address else None
    service, admission = build_service(config, metrics=metrics, on_drain=lambda draining: _health_soon(health_servicer, draining))
    loop = LoopThread()
    try:
        return loop.run(_build(config, service, admission, health_servicer, metrics, loop))
    except BaseException:
        service.guard.pool.close()
        loop.close()
        raise


async def _build(config: ServerConfig, service: KVPoolService, admission: Admission, health_servicer: Any,
                 metrics: KVPoolMetrics | None, loop: LoopThread) -> ServerHandle:
    executor = ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="kvpool-copy")
    streams = OpenStreams(config.max_streams, config.stream_idle_timeout_s)
    background = BackgroundTasks()
    if config.stream_idle_timeout_s:
        background.every(min(1.0, config.stream_idle_timeout_s / 4), streams.sweep, "idle-streams")
    background.every(REAP_INTERVAL_S, service.sessions.reap_expired, "sessions-reaper")  # leases that ran out
    scope = CallScope(admission, service.auth, metrics)
    fast_path = None if config.no_fast_path else FastPathServer(
        service, scope, area_bytes=config.fast_path_area_bytes, max_channels=config.fast_path_max_channels,
        executor=executor)
    server = grpc.aio.server(options=grpc_options(config))
    try:
        handlers = method_handlers(service, scope, executor, streams, fast_path)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        add_reflection(server)
        port = bind(server, config, StartupError)
    except BaseException:
        executor.shutdown(wait=False)
        if fast_path is not None:
            fast_path.stop()
        raise
    return ServerHandle(server, port, service.guard.pool, service, admission, health_servicer, loop, executor,
                        streams, background, metrics, config.metrics_address, fast_path=fast_path)
