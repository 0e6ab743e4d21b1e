"""KV events on vLLM's ZMQ wire (--kv-events-publish), for llm-d's indexer and Dynamo's router (docs/scale-out.md).

A transport-side adapter of the event feed (service/events.py): ``start_publisher(config, guard)`` after the
service is built, ``publisher.stop()`` at shutdown. pyzmq and msgpack are imported only when the flag is given.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from kvpool_server.config import ServerConfig
from kvpool_server.service.build import StartupError
from kvpool_server.service.guard import CoreGuard

if TYPE_CHECKING:
    from kvpool_server.zmq_events.publisher import ZmqEventPublisher

__all__ = ["pod_names", "start_publisher", "tenant_models"]


def pod_names(config: ServerConfig) -> list[str]:
    """The topics' pods: --kv-events-pod (comma-separated), else this host's name."""
    return [p.strip() for p in config.kv_events_pod.split(",") if p.strip()] or [socket.gethostname()]


def tenant_models(config: ServerConfig) -> dict[bytes, str]:
    """Salt (a tenant's name, UTF-8; b"" without authentication) -> the model name its blocks are published under."""
    models = {b"": config.kv_events_model} if config.kv_events_model else {}
    for name, model in config.kv_events_tenant_model_map().items():
        models[name.encode()] = model
    return models


def start_publisher(config: ServerConfig, guard: CoreGuard) -> ZmqEventPublisher | None:
    """The publisher --kv-events-publish asks for, started (None without the flag). Raises StartupError when pyzmq
    or msgpack is missing or an endpoint cannot be bound."""
    if not config.kv_events_publish:
        return None
    missing = [package for module, package in (("zmq", "pyzmq"), ("msgpack", "msgpack")) if not _imports(module)]
    if missing:
        raise StartupError(
            f"--kv-events-publish needs pyzmq and msgpack ({' and '.join(missing)} not installed): pip install pyzmq "
            "msgpack (they are in requirements/server.txt, and kvpool-server's extra [kv-events])")
    import zmq
    from kvpool_server.zmq_events.publisher import ZmqEventPublisher
    from kvpool_server.zmq_events.wire import TopicMap

    try:
        publisher = ZmqEventPublisher(
            guard.events, guard.lock, TopicMap(pod_names(config), tenant_models(config)),
            endpoint=config.kv_events_publish, connect=config.kv_events_connect,
            replay_endpoint=config.kv_events_replay, layout=config.kv_events_layout,
            max_queue_bytes=config.kv_events_queue_bytes, replay_batches=config.kv_events_replay_batches,
            replay_bytes=config.kv_events_replay_bytes, socket_per_model=config.kv_events_socket_per_model,
            replay_peer_bytes=config.kv_events_replay_peer_bytes,
            replay_queued_bytes=config.kv_events_replay_queued_bytes)
    except zmq.ZMQError as exc:
        raise StartupError(f"--kv-events-publish {config.kv_events_publish} / --kv-events-replay "
                           f"{config.kv_events_replay or '(none)'}: {exc}") from None
    publisher.start()
    return publisher


def _imports(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
