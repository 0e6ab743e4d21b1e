"""Every KVPoolService RPC on gRPC, one way: its request fields -> a service call -> its response message.

Three kinds, each served by one handler (``handlers.py``, ``streams.py``) chosen by the method's kind in the proto,
never by its name:

    Unary(request_cls, invoke, encode, bulk)               invoke(service, call, request) -> answer | Offload
    BidiStream(request_cls, open, message, close)          AppendTokenStream, KeepAlive: per-stream state
    ServerStream(request_cls, follow, encode, shed)        SubscribeEvents: an async iterator of answers

Nothing here decides anything: decisions are the service's (service/); this module only names fields.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from kvpool import fastpath as fp
from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.core.errors import FailedPreconditionError
from kvpool_server.core import AppendPlan
from kvpool_server.grpc_api import messages
from kvpool_server.grpc_api.fair_calls import HashedRegister, HashedRegisterMany
from kvpool_server.grpc_api.status import PEER_KEY
from kvpool_server.fastpath.server import FastPathServer
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.register_batch import PromptToRegister
from kvpool_server.service.scope import Call


@dataclass(frozen=True)
class Unary:
    request_cls: type
    invoke: Callable[[KVPoolService, Call, Any], Any]
    encode: Callable[[KVPoolService, Any], Any]
    bulk: str = ""  # a bytes field a large request carries: read as a view of the body, not copied (bulk.py)


@dataclass(frozen=True)
class BidiStream:
    request_cls: type
    open: Callable[[KVPoolService, Call], Any]  # -> per-stream state
    message: Callable[[KVPoolService, Call, Any, Any], Any]  # (service, call, state, request) -> response
    close: Callable[[KVPoolService, Any, str], None]  # once, however the stream ended; must not raise


@dataclass(frozen=True)
class ServerStream:
    request_cls: type
    follow: Callable[[KVPoolService, Call, Any, Callable[[], bool]], AsyncGenerator[Any, None]]  # stopping() ends it
    encode: Callable[[KVPoolService, Any], Any]
    # why the service cancelled the stream running in a task (None: it did not, the client did)
    shed: Callable[[KVPoolService, asyncio.Task | None], Exception | None] = lambda s, task: None


def _append(service: KVPoolService, call: Call, r: Any) -> AppendPlan:
    return service.append(call, r.seq_ids, r.num_tokens, r.token_ids, r.session_id, r.request_id)


def _register(service: KVPoolService, call: Call, r: Any) -> Any:
    """``r``: the request, or a ``HashedRegister`` of it (its prompt hashed off the loop: fair_calls.py)."""
    prompt: Any = r.prompt if isinstance(r, HashedRegister) else r.prompt_token_ids
    hashes = r.hashes if isinstance(r, HashedRegister) else None
    return service.register(call, r.seq_id if r.HasField("seq_id") else None, r.session_id, r.request_id,
                            prompt, r.public_prefix_len, r.cache_extra_key, hashes)


def _register_many(service: KVPoolService, call: Call, r: Any) -> Any:
    """``r``: the request, or a ``HashedRegisterMany`` of it (its prompts hashed off the loop: fair_calls.py)."""
    if isinstance(r, HashedRegisterMany):
        return service.register_many(call, r.prompts, r.session_id, r.request_id, r.hashes)
    prompts = [PromptToRegister(p.prompt_token_ids, p.public_prefix_len, p.cache_extra_key) for p in r.prompts]
    return service.register_many(call, prompts, r.session_id, r.request_id)


def _registered_many(service: KVPoolService, answer: Any) -> pb.RegisterSequencesResponse:
    return pb.RegisterSequencesResponse(sequences=[
        pb.RegisteredSequence(seq_id=a.seq_id, num_cached_tokens=a.num_cached_tokens,
                              cached_block_ids=a.cached_block_ids.tolist()) for a in answer])


def _fork(service: KVPoolService, call: Call, r: pb.ForkRequest) -> list[int]:
    return service.fork(call, r.parent_seq_id, r.num_children, r.child_seq_ids, r.session_id, r.request_id)


def _read_kv_response(service: KVPoolService, data: bytes) -> pb.ReadKVResponse:
    return pb.ReadKVResponse(data=data, num_tokens=len(data) // service.wire.token_bytes)


def _follow_events(service: KVPoolService, call: Call, r: pb.SubscribeEventsRequest,
                   stopping: Callable[[], bool]) -> AsyncGenerator[Any, None]:
    return service.guard.events.follow(service.guard.lock, r.from_seq if r.HasField("from_seq") else None,
                                       r.epoch if r.HasField("epoch") else None, stopping, call.caller.tenant)


def _events_response(service: KVPoolService, answer: Any) -> pb.SubscribeEventsResponse:
    batch, num_dropped = answer
    return messages.batch_message(batch, num_dropped, service.guard.events.medium)


def open_fast_path(fast_path: FastPathServer | None) -> Unary:
    """OpenFastPath's row for a server whose shared-memory channels are ``fast_path`` (None: the fast path is off)."""

    def invoke(service: KVPoolService, call: Call, r: pb.OpenFastPathRequest) -> Any:
        if fast_path is None:
            raise FailedPreconditionError("this server has the fast path off (--no-fast-path): use gRPC")
        return fast_path.open(call, r.session_id, call.headers.get(PEER_KEY))

    return Unary(pb.OpenFastPathRequest, invoke, _fast_path_response)


def _fast_path_response(service: KVPoolService, answer: Any) -> pb.OpenFastPathResponse:
    channel, address = answer
    return pb.OpenFastPathResponse(shm_name=channel.name, socket_address=address, token=channel.token,
                                   segment_bytes=fp.segment_bytes(channel.area_bytes), area_bytes=channel.area_bytes,
                                   generation=channel.generation, max_batch=service.max_batch)


def _close_append_stream(service: KVPoolService, state: Any, reason: str) -> None:
    pass  # an append stream owns nothing


RPCS: dict[str, Unary | BidiStream | ServerStream] = {
    "RegisterSequence": Unary(
        pb.RegisterSequenceRequest, _register,
        lambda s, a: pb.RegisterSequenceResponse(seq_id=a.seq_id, num_cached_tokens=a.num_cached_tokens)),
    "RegisterSequences": Unary(pb.RegisterSequencesRequest, _register_many, _registered_many),
    "AppendToken": Unary(
        pb.AppendTokenRequest, _append, lambda s, plan: messages.append_response(plan, pb.AppendTokenResponse)),
    "AppendTokenStream": BidiStream(
        pb.AppendTokenStreamRequest, lambda s, call: None,
        lambda s, call, state, r: messages.append_response(_append(s, call, r), pb.AppendTokenStreamResponse),
        _close_append_stream),
    "Fork": Unary(pb.ForkRequest, _fork, lambda s, children: pb.ForkResponse(child_seq_ids=children)),
    "Free": Unary(
        pb.FreeRequest, lambda s, call, r: s.free(call, r.seq_ids, r.session_id, r.request_id),
        lambda s, n: pb.FreeResponse(num_blocks_freed=n)),
    "Stats": Unary(
        pb.StatsRequest, lambda s, call, r: s.stats(call),
        lambda s, a: messages.stats_with_tenants(a, s.guard.pool.layout.block_bytes, s.tier_copies())),
    "GetBlockTable": Unary(
        pb.GetBlockTableRequest, lambda s, call, r: s.block_table(call, r.seq_id),
        lambda s, t: pb.GetBlockTableResponse(block_ids=t.block_ids.tolist(), num_tokens=t.num_tokens,
                                              block_size=t.block_size, block_hashes=t.block_hashes)),
    "DescribePool": Unary(
        pb.DescribePoolRequest, lambda s, call, r: s.describe_pool(call),
        lambda s, d: messages.describe_pool_response(d)),
    "WriteKV": Unary(
        pb.WriteKVRequest, lambda s, call, r: s.write_kv(call, r.seq_id, r.start_position, r.data, r.session_id),
        lambda s, n: pb.WriteKVResponse(num_tokens_written=n), bulk="data"),
    "ReadKV": Unary(
        pb.ReadKVRequest, lambda s, call, r: s.read_kv(call, r.seq_id, r.start_position, r.num_tokens),
        _read_kv_response),
    "CheckInvariants": Unary(
        pb.CheckInvariantsRequest, lambda s, call, r: s.check_invariants(call),
        lambda s, a: pb.CheckInvariantsResponse(ok=True, num_blocks_checked=a.num_blocks_checked,
                                                num_sequences_checked=a.num_sequences_checked)),
    "SubscribeEvents": ServerStream(pb.SubscribeEventsRequest, _follow_events, _events_response,
                                    lambda s, task: s.guard.events.shed_error(task)),
    "OpenSession": Unary(
        pb.OpenSessionRequest, lambda s, call, r: s.sessions.open(call, r.client_name, r.lease_ttl_ms),
        lambda s, session: pb.OpenSessionResponse(session_id=session.session_id,
                                                  server_epoch=s.sessions.table.server_epoch,
                                                  lease_ttl_ms=messages.ms(session.lease_ttl_s))),
    "KeepAlive": BidiStream(
        pb.KeepAliveRequest, lambda s, call: s.sessions.keep_alive_opened(call),
        lambda s, call, state, r: pb.KeepAliveResponse(
            lease_remaining_ms=messages.ms(s.sessions.keep_alive(state, r.session_id))),
        lambda s, state, reason: s.sessions.keep_alive_ended(state)),
    "CloseSession": Unary(
        pb.CloseSessionRequest, lambda s, call, r: s.sessions.close(call, r.session_id),
        lambda s, a: pb.CloseSessionResponse(num_sequences_freed=a[0], num_blocks_freed=a[1])),
    "ListSessions": Unary(
        pb.ListSessionsRequest, lambda s, call, r: s.sessions.live_sessions(call, r.page_size, r.page_token),
        lambda s, a: pb.ListSessionsResponse(sessions=[messages.session_info(*row) for row in a[0]],
                                             server_epoch=s.sessions.table.server_epoch, next_page_token=a[1])),
    "ListSequences": Unary(
        pb.ListSequencesRequest, lambda s, call, r: s.sessions.sequences(call, r.session_id, r.page_size, r.page_token),
        lambda s, a: pb.ListSequencesResponse(sequences=[
            pb.SequenceInfo(seq_id=i[0], session_id=i[1], num_tokens=i[2], num_blocks=i[3]) for i in a[0]],
            next_page_token=a[1])),
    "OpenFastPath": open_fast_path(None),  # build_server's method_handlers gives it the server's FastPathServer
    "Drain": Unary(
        pb.DrainRequest, lambda s, call, r: s.drain(call, r.resume),
        lambda s, a: pb.DrainResponse(num_sessions=a[0], num_sequences=a[1])),
}
