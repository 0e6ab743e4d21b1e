"""The unary handler: raw request bytes -> the request message -> the call scope -> the service -> the reply bytes.

Handlers are registered with no request deserializer and no response serializer, so the bytes of a request that
does not parse never reach gRPC's own deserializer (which answers INTERNAL, logs a traceback and leaked ~16 KB a
call on grpcio 1.84): here it is INVALID_ARGUMENT, nothing logged, nothing kept.

Everything else -- admission, authentication, the status of an error, metrics -- is the call scope's
(service/scope.py), and the locking, fencing, replay and events are the service's: this module only decodes,
encodes and runs the service's ``Offload`` / ``Wait`` answers (service/offload.py) on the event loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvpool_server.core import InvalidArgumentError
from kvpool_server.grpc_api.methods import Unary
from kvpool_server.grpc_api.status import MetadataHeaders, abort
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.offload import Offload, Wait
from kvpool_server.service.scope import CallScope

BIG_MESSAGE_BYTES = 1 << 20  # requests longer than this are parsed on a copy thread, not on the event loop


def parse_request(request_cls: Any, raw: bytes, rpc: str) -> Any:
    try:
        return request_cls.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgumentError(
            f"{rpc}: the request bytes are not a {request_cls.DESCRIPTOR.full_name} message ({exc})"
        ) from None


def unary_handler(service: KVPoolService, scope: CallScope, executor: Executor, rpc: str,
                  method: Unary) -> grpc.RpcMethodHandler:
    request_cls: Any = method.request_cls
    invoke, encode = method.invoke, method.encode
    parse = request_cls.FromString

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        call = scope.call(rpc, MetadataHeaders(context))
        try:
            with call:
                if len(raw) > BIG_MESSAGE_BYTES:
                    loop = asyncio.get_running_loop()
                    request = await loop.run_in_executor(executor, parse_request, request_cls, raw, rpc)
                else:
                    try:
                        request = parse(raw)
                    except DecodeError:
                        request = parse_request(request_cls, raw, rpc)  # raises with the message
                while True:
                    try:
                        answer = invoke(service, call, request)
                        break
                    except Wait as wait:
                        await wait.until
                if isinstance(answer, Offload):
                    return await _offloaded(service, executor, answer, encode)
                return encode(service, answer).SerializeToString()
        except Exception:
            await abort(context, call.status)

    return grpc.unary_unary_rpc_method_handler(handle)


async def _offloaded(service: KVPoolService, executor: Executor, offload: Offload, encode: Any) -> bytes:
    """Run ``offload.work`` (and the encoding) on a copy thread; ``finish`` on the loop once it has ended."""

    def work_and_encode() -> bytes:
        return encode(service, offload.work()).SerializeToString()

    done = asyncio.get_running_loop().run_in_executor(executor, work_and_encode)
    if offload.finish is not None:
        finish = offload.finish
        done.add_done_callback(lambda _: finish())
    # shield: a cancelled call must not run ``finish`` (unpin, ...) while ``work`` still runs
    return await asyncio.shield(done)
