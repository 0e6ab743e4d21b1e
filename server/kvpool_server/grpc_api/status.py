"""The service's ``Status`` on gRPC: its code as ``grpc.StatusCode``, its reason as trailing metadata, and the
call's metadata as the service's ``Headers``."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from kvpool_server.service.errors import REASON_KEY, Status

async def abort(context: grpc.aio.ServicerContext, status: Status) -> NoReturn:
    """End the call with ``status`` (raises, as ``context.abort`` does)."""
    metadata = ((REASON_KEY, status.reason),) if status.reason else ()
    await context.abort(grpc.StatusCode[status.code.name], status.message, metadata)
    raise AssertionError("unreachable: abort raises")


PEER_KEY = ":peer"  # MetadataHeaders.get(PEER_KEY): gRPC's peer ("unix:...", "ipv4:127.0.0.1:5555", ...)


class MetadataHeaders:
    """A call's invocation metadata, read (once) only when the service asks for a header."""

    __slots__ = ("_context", "_metadata")

    def __init__(self, context: Any) -> None:
        self._context = context
        self._metadata: dict[str, Any] | None = None

    def get(self, key: str) -> str | None:
        if key == PEER_KEY:  # not metadata (a client cannot send a key starting with ':')
            peer = self._context.peer()
            return peer.decode() if isinstance(peer, bytes) else peer
        if self._metadata is None:
            self._metadata = dict(self._context.invocation_metadata() or ())
        value = self._metadata.get(key)
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
