"""build_server(config): the pool, the core, the servicer and the grpc.aio server around them (KVPoolService,
health, reflection v1 and v1alpha), bound to its addresses but not started -- ``ServerHandle.start()`` does that
(main.serve, tests, benchmarks). ``build_servicer(config)`` is the part without gRPC's server.

The server runs on an asyncio event loop of its own thread ("kvpool-loop"), so the process's main thread stays free
for signals (main.serve) and synchronous callers (tests, ``main.shutdown``) drive it through ``ServerHandle.run``.
Why asyncio: a stream costs a coroutine, not one of a fixed pool of threads (docs/api.md, "The server's design").
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from kvpool.v1 import kvpool_pb2
from kvpool_server.auth import Authenticator, TokensFileError
from kvpool_server.background import BackgroundTasks
from kvpool_server.config import ServerConfig, pool_error_message
from kvpool_server.core import KVCacheManager, KVPoolError
from kvpool_server.core.sessions import SessionTable, new_server_epoch
from kvpool_server.device import create_pool
from kvpool_server.drain import Drain
from kvpool_server.errors import ServerShuttingDownError
from kvpool_server.handlers import CallContext, unary_handler
from kvpool_server.metrics import KVPoolMetrics, MetricsHTTPServer, locked_stats, start_metrics_server
from kvpool_server.pool_protocol import Pool
from kvpool_server.service import KVPoolServicer
from kvpool_server.session_rpcs import REAP_INTERVAL_S
from kvpool_server.event_stream import events_handler
from kvpool_server.streams import OpenStreams, stream_handler
from kvpool_server.transport import bind

SERVICE = kvpool_pb2.DESCRIPTOR.services_by_name["KVPoolService"]
SERVICE_NAME = SERVICE.full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
T = TypeVar("T")


class StartupError(RuntimeError):
    """The server cannot start (address in use, no GPU, ...); the message says why."""


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
    servicer: KVPoolServicer
    drain: Drain  # the servicer's: shutdown starts it
    health: health.aio.HealthServicer
    loop: LoopThread
    executor: ThreadPoolExecutor  # copy threads (big WriteKV/ReadKV, CheckInvariants, big requests' parsing)
    streams: OpenStreams
    background: BackgroundTasks  # periodic work on the loop: ``handle.background.every(interval_s, fn)``
    metrics: KVPoolMetrics | None = None
    metrics_address: str = ""
    metrics_http: MetricsHTTPServer | None = field(default=None)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the server's event loop and wait for its result (from any other thread)."""
        return self.loop.run(coro, timeout)

    def start(self) -> None:
        """Start serving; health says SERVING (for "" and KVPoolService) from now on; metrics over HTTP when
        configured. Raises StartupError if the metrics address cannot be bound."""
        if self.metrics is not None:
            self.metrics.watch_pool(locked_stats(self.servicer.manager, self.servicer.lock),
                                    self.servicer.session_gauges, block_bytes=self.pool.layout.block_bytes)
            try:
                self.metrics_http = start_metrics_server(self.metrics_address, self.metrics.registry)
            except OSError as exc:
                raise StartupError(str(exc)) from exc
        self.run(self._start())

    async def _start(self) -> None:
        await self.server.start()
        self.background.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def begin_drain(self) -> None:
        """Shutdown's first step: refuse new calls (the Drain), health NOT_SERVING, and end every stream waiting
        for its client's next message with UNAVAILABLE."""
        self.drain.start()
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
        # Ping every connection every keepalive_time_s, idle or not; a peer that does not answer within
        # keepalive_timeout_s is gone, and its calls (streams included) are cancelled.
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # clients may ping every 10 s
    ]


def build_servicer(config: ServerConfig) -> KVPoolServicer:
    """Allocate the pool and make the core and the servicer over it. Raises StartupError, with nothing left
    allocated, if the pool cannot be made or the configuration does not fit it."""
    config.validate()
    try:
        pool = create_pool(config.layout, backend=config.backend, **config.pool_size_kwargs())
    except Exception as exc:
        raise StartupError(pool_error_message(config.backend, exc)) from exc
    try:
        manager = KVCacheManager(
            pool.num_blocks, config.block_size, max_seq_len=config.max_seq_len, max_num_seqs=config.max_num_seqs,
            tenancy=bool(config.auth_tokens),
        )
        sessions = SessionTable(new_server_epoch(), default_ttl_s=config.session_ttl_ms / 1000.0,
                                max_ttl_s=config.max_session_ttl_ms / 1000.0)
        servicer = KVPoolServicer(manager, pool, Drain(), sessions, max_batch=config.max_batch,
                                  max_message_bytes=config.max_message_bytes,
                                  max_tokens_per_call=config.max_tokens_per_call,
                                  event_buffer_batches=config.event_buffer_batches,
                                  max_event_subscribers=config.max_event_subscribers)
        if config.auth_tokens:
            servicer.auth = Authenticator(config.auth_tokens, manager.tenants, manager.num_blocks)
        return servicer
    except TokensFileError as exc:
        pool.close()
        raise StartupError(str(exc)) from exc
    except KVPoolError as exc:
        pool.close()
        raise StartupError(f"bad pool configuration: {exc}") from exc
    except BaseException:
        pool.close()
        raise


def _count_append(metrics: KVPoolMetrics, response: Any) -> None:
    metrics.count_append(1, len(response.slot_mapping))


def _count_fork(metrics: KVPoolMetrics, response: Any) -> None:
    metrics.count_fork(len(response.child_seq_ids))


COUNTERS = {"AppendToken": _count_append, "AppendTokenStream": _count_append, "Fork": _count_fork}


def _not_serving_soon(health_servicer: Any) -> None:
    """Health NOT_SERVING for everything, from a handler on the loop (the Drain RPC)."""
    for service in ("", SERVICE_NAME):
        asyncio.get_running_loop().create_task(
            health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING))


def method_handlers(servicer: Any, call: CallContext, streams: OpenStreams) -> dict[str, grpc.RpcMethodHandler]:
    """A raw-bytes handler for every KVPoolService method the servicer has: unary ones are plain methods
    ``(request, context) -> response``, streaming ones ``StreamMethod`` objects."""
    handlers = {}
    for name, method in SERVICE.methods_by_name.items():
        impl = getattr(servicer, name, None)
        if impl is None:
            continue
        if name == "SubscribeEvents":
            handlers[name] = events_handler(call, servicer)
        elif method.client_streaming or method.server_streaming:
            handlers[name] = stream_handler(call, name, impl, streams, COUNTERS.get(name))
        else:
            handlers[name] = unary_handler(call, name, impl, GetMessageClass(method.input_type), COUNTERS.get(name))
    return handlers


def build_server(config: ServerConfig) -> ServerHandle:
    """``build_servicer`` plus the grpc.aio server (KVPoolService, health, reflection) on a loop thread, bound to
    ``config``'s addresses, not started. Raises StartupError (with nothing left allocated) if an address cannot be
    bound."""
    servicer = build_servicer(config)
    loop = LoopThread()
    try:
        return loop.run(_build(config, servicer, loop))
    except BaseException:
        servicer.pool.close()
        loop.close()
        raise


async def _build(config: ServerConfig, servicer: KVPoolServicer, loop: LoopThread) -> ServerHandle:
    executor = ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="kvpool-copy")
    metrics = KVPoolMetrics() if config.metrics_address else None
    streams = OpenStreams(config.max_streams, config.stream_idle_timeout_s)
    background = BackgroundTasks()
    if config.stream_idle_timeout_s:
        background.every(min(1.0, config.stream_idle_timeout_s / 4), streams.sweep, "idle-streams")
    background.every(REAP_INTERVAL_S, servicer.reap_expired, "sessions-reaper")  # leases that ran out
    if metrics is not None:
        servicer.on_session_end = metrics.session_reclaimed
    call = CallContext(servicer.drain, executor, metrics, servicer.auth)
    server = grpc.aio.server(options=grpc_options(config))
    try:
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, method_handlers(servicer, call, streams)),)
        )
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        servicer.on_drain = lambda: _not_serving_soon(health_servicer)
        _add_reflection(server)
        port = bind(server, config, StartupError)
    except BaseException:
        executor.shutdown(wait=False)
        raise
    return ServerHandle(server, port, servicer.pool, servicer, servicer.drain, health_servicer, loop, executor,
                        streams, background, metrics, config.metrics_address)


def _add_reflection(server: grpc.aio.Server) -> None:
    """Server reflection as ``grpc.reflection.v1alpha`` (grpcio-reflection's) and ``grpc.reflection.v1`` (the same
    messages under the v1 names: one servicer, a second handler; the v1 file is added to the descriptor pool so that
    the v1 service can describe itself too)."""
    _register_v1_reflection_descriptor()
    names = (SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }),))


def _register_v1_reflection_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    for message in proto.message_type:
        for f in message.field:
            f.type_name = f.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    try:
        pool.AddSerializedFile(proto.SerializeToString())
    except Exception:  # another copy of the v1 file (another library's) got there first: fine, it is the same
        pass
