"""The unary handler: raw request bytes -> the request message -> the call scope -> the service -> the reply bytes.

Handlers are registered with no request deserializer and no response serializer, so the bytes of a request that
does not parse never reach gRPC's own deserializer (which answers INTERNAL, logs a traceback and leaked ~16 KB a
call on grpcio 1.84): here it is INVALID_ARGUMENT, nothing logged, nothing kept. A body longer than any valid
request of its method is refused by its length before it is parsed (``request_bounds``); a method with a bulk field
(WriteKV) is read from gRPC only once the byte budget admits it (``admitted_reads``).

Everything else -- admission, authentication, the status of an error, metrics -- is the call scope's
(service/scope.py), and the locking, fencing, replay and events are the service's: this module only decodes,
encodes, and hands every answer of the service to the one adapter (``answers.honour``, shared with the fast
path), whose ``Pending`` (an ``Offload`` / ``Wait``) it awaits on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvpool_server.core import InvalidArgumentError
from kvpool_server.grpc_api import fair_calls
from kvpool_server.grpc_api.admitted_reads import Charge, read_admitted
from kvpool_server.grpc_api.bulk import BulkRequest, split_bulk
from kvpool_server.grpc_api.methods import Unary
from kvpool_server.grpc_api.request_bounds import Bound, check_size, field_limits, max_request_bytes
from kvpool_server.grpc_api.status import MetadataHeaders, abort
from kvpool_server.service.byte_budget import BIG_MESSAGE_BYTES, MAX_WAIT_S
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service import answers
from kvpool_server.service.scope import Call, CallScope



def parse_request(request_cls: Any, raw: bytes, rpc: str) -> Any:
    try:
        return request_cls.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgumentError(
            f"{rpc}: the request bytes are not a {request_cls.DESCRIPTOR.full_name} message ({exc})"
        ) from None


async def parse_big(request_cls: Any, raw: bytes, rpc: str, bulk: str, executor: Executor) -> Any:
    """A body over BIG_MESSAGE_BYTES: its bulk field as a view of ``raw`` (no copy) where it has one and the body
    is plain, else parsed whole on a copy thread (not on the event loop)."""
    if bulk:
        split = split_bulk(raw, request_cls.DESCRIPTOR.fields_by_name[bulk].number)
        if split is not None:
            rest, view = split
            return BulkRequest(parse_request(request_cls, rest, rpc), bulk, view)
    return await asyncio.get_running_loop().run_in_executor(executor, parse_request, request_cls, raw, rpc)


def request_bound(service: KVPoolService, request_cls: Any) -> Bound | None:
    """The most bytes a valid ``request_cls`` can take under this server's limits (request_bounds.py)."""
    limits = field_limits(max_seq_len=service.limits.max_seq_len, max_batch=service.max_batch,
                          max_tokens_per_call=service.limits.max_tokens_per_call)
    return max_request_bytes(request_cls.DESCRIPTOR, limits)


def _max_wait_s(context: grpc.aio.ServicerContext) -> float:
    remaining = context.time_remaining()
    return MAX_WAIT_S if remaining is None else min(MAX_WAIT_S, remaining)


def unary_handler(service: KVPoolService, scope: CallScope, executor: Executor, rpc: str,
                  method: Unary) -> grpc.RpcMethodHandler:
    """``method`` as a raw-bytes handler. A method with a bulk field (WriteKV) is registered as stream-unary, so
    that gRPC reads its body only once the byte budget admits it (``admitted_reads.read_admitted``); the client
    still makes a unary call (the wire is the same)."""
    request_cls: Any = method.request_cls
    invoke, encode, bulk = method.invoke, method.encode, method.bulk
    parse = request_cls.FromString
    budget = service.inflight
    bound = request_bound(service, request_cls)
    reserve = min(service.limits.max_message_bytes, budget.max_bytes)  # an unread body's most
    reading = asyncio.Semaphore(1)  # one body of this method read from gRPC at a time (admitted_reads.py)

    async def serve(call: Call, raw: bytes, charge: Charge, context: grpc.aio.ServicerContext) -> bytes:
        """The call, its body received: parse (a large body charged first), run the service, encode."""
        check_size(bound, len(raw), rpc)  # before any parsing, any charge
        started = time.perf_counter()
        if len(raw) > BIG_MESSAGE_BYTES:
            if not charge.num_bytes:
                await budget.acquire(len(raw), rpc, _max_wait_s(context))
                charge.num_bytes = len(raw)
                started = time.perf_counter()
            request = await parse_big(request_cls, raw, rpc, bulk, executor)
        else:
            try:
                request = parse(raw)
            except DecodeError:
                request = parse_request(request_cls, raw, rpc)  # raises with the message
        parsed_s = time.perf_counter() - started
        request = await fair_calls.take_turn(service, call, request, _max_wait_s(context))
        started = time.perf_counter()
        # every answer kind through the one adapter; an Offload's copy holds the body: released when it ends
        reply = answers.honour(lambda: invoke(service, call, request),
                               lambda answer: encode(service, answer).SerializeToString(),
                               hand_over=charge.hand_over)
        if isinstance(reply, answers.Pending):
            pending, reply = reply, await reply.settle(executor)
            if pending.offloaded:
                return reply
        fair_calls.charge(service, call, request, parsed_s + time.perf_counter() - started)
        return reply

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        call = scope.call(rpc, MetadataHeaders(context))
        charge = Charge(budget)
        try:
            with call:
                return await serve(call, raw, charge, context)
        except Exception as exc:
            # The traceback's frames hold the body (a view of it, the decoded tokens): drop them now, not at the
            # next cyclic GC -- 16 failed 64 MiB WriteKVs otherwise stay resident.
            exc.__traceback__ = None
            raw = b""  # noqa: F841
            await abort(context, call.status)
        finally:
            charge.release()
        return b""  # not reached: abort raises

    async def handle_unread(request_iterator: Any, context: grpc.aio.ServicerContext) -> bytes:
        call = scope.call(rpc, MetadataHeaders(context))
        charge = Charge(budget)
        raw = b""
        try:
            with call:
                raw = await read_admitted(context, charge, rpc, _max_wait_s(context), reserve, reading)
                return await serve(call, raw, charge, context)
        except Exception as exc:
            exc.__traceback__ = None
            raw = b""  # noqa: F841
            await abort(context, call.status)
        finally:
            charge.release()
        return b""  # not reached: abort raises

    if bulk:
        return grpc.stream_unary_rpc_method_handler(handle_unread)
    return grpc.unary_unary_rpc_method_handler(handle)
