"""KVPoolServicer: protobuf <-> core, nothing else.

Each method is a plain synchronous function ``(request, context) -> response`` run on the server's event loop
thread (``handlers.py`` parses the raw request, admits it through the Drain, maps errors, counts metrics): parse
the request (``parse``) -> call the core (and the pool) under one lock -> build the response (``responses``). The
servicer checks before it calls the core and the core raises before it changes anything, so a failed call leaves
the pool exactly as it was. A mutation whose reply might not be deliverable is refused before it is applied
(``reply_limits``).

One ``threading.Lock`` covers the manager *and* the pool. Every call runs on the one loop thread, so the lock is
what keeps other threads -- the metrics scrape, the shutdown that closes the pool -- from seeing half a call.

Work too slow for the loop is handed off (``handlers.Offload``): big WriteKV/ReadKV copies run on a copy thread in
1 MiB chunks with their sequence pinned (``kv_copies``); CheckInvariants checks a copy of the manager taken under
the lock (``invariant_checks``).

AppendTokenStream is a ``StreamMethod`` (``streams.py``): ``open`` / ``message`` / ``close``; each message is
AppendToken's own code, ``append_rpc.append``.

Tenants (``auth.caller()``, set by the handler): every call passes the caller's ``tenant_id`` to the core and the
gate, which answer NOT_FOUND for another tenant's sequence or session (None without authentication: no check).

Every mutating call passes the ``SessionGate`` first, under the lock: the session it names must be live (fencing),
and a repeated request id gets its first answer (safe retries). The session RPCs, KeepAlive included (a
``StreamMethod`` whose ``close`` may end its session), are ``session_rpcs``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server import parse
from kvpool_server.append_rpc import append
from kvpool_server.auth import Authenticator, caller, check_may_share_prefixes
from kvpool_server.core import KVCacheManager
from kvpool_server.core.sessions import SessionTable, new_server_epoch
from kvpool_server.drain import Drain
from kvpool_server.event_stream import EventFeed
from kvpool_server.handlers import Offload
from kvpool_server.invariant_checks import InvariantChecks
from kvpool_server.kv_copies import INLINE_BYTES, SequencePins, chunk_tokens, read_chunked, write_chunked
from kvpool_server.kv_wire import ENVELOPE_BYTES, KVWire
from kvpool_server.pool_protocol import Pool
from kvpool_server.replies import ReplyCache
from kvpool_server.reply_limits import ReplyLimits
from kvpool_server.responses import describe_pool_response, stats_response, tenant_usage
from kvpool_server.session_gate import SessionGate
from kvpool_server.session_rpcs import KeepAlive, SessionRpcs

DEFAULT_MAX_TOKENS_PER_CALL = 1 << 17


def _no_metrics(reason: str, latency_s: float, num_sequences: int, num_blocks: int) -> None:
    pass


class KVPoolServicer(SessionRpcs):
    """The KVPoolService RPCs over one KVCacheManager and one pool (see docs/api.md); the session RPCs come from
    ``SessionRpcs``. A method the servicer lacks is not registered: gRPC answers UNIMPLEMENTED."""

    def __init__(
        self, manager: KVCacheManager, pool: Pool, drain: Drain | None = None, sessions: SessionTable | None = None,
        *, max_batch: int, max_message_bytes: int, max_tokens_per_call: int = DEFAULT_MAX_TOKENS_PER_CALL,
        event_buffer_batches: int = 10_000, max_event_subscribers: int = 64,
    ) -> None:
        self.manager = manager
        self.pool = pool
        self.drain = drain if drain is not None else Drain()
        self.lock = threading.Lock()
        self.max_batch = max_batch
        self.wire = KVWire(pool.layout, max_message_bytes)
        self.limits = ReplyLimits(max_message_bytes, manager.num_blocks, manager.block_size,
                                  max_seq_len=manager.max_seq_len, max_tokens_per_call=max_tokens_per_call)
        self.pins = SequencePins()
        self.invariants = InvariantChecks(manager)
        self.chunk_tokens = chunk_tokens(pool.layout.token_bytes)
        self.AppendTokenStream = AppendTokenStream(self)
        self.sessions = sessions if sessions is not None else SessionTable(new_server_epoch())
        self.replies = ReplyCache()
        self.gate = SessionGate(self.sessions, self.replies)
        self.on_session_end = _no_metrics  # KVPoolMetrics.session_reclaimed, when metrics are on
        self.KeepAlive = KeepAlive(self)
        self.draining_for_maintenance = False
        self.on_drain: Callable[[], None] = lambda: None
        self.auth: Authenticator | None = None  # set with --auth-tokens (grpc_server.build_servicer)
        # SubscribeEvents: the prefix cache's KV events, the last event_buffer_batches batches kept
        self.events = EventFeed(self.sessions.server_epoch, manager.allocator.cache, event_buffer_batches,
                                medium="GPU" if pool.backend == "gpu" else "CPU",
                                max_subscribers=max_event_subscribers)
        self.SubscribeEvents = self.events  # registered by grpc_server (event_stream.events_handler)

    def reload_tokens(self) -> bool:
        """SIGHUP: re-read the tokens file (under the lock: it changes the tenants' limits)."""
        if self.auth is None:
            return False
        with self.lock:
            return self.auth.reload()

    # ---------------------------------------------------------------- sequences
    def RegisterSequence(self, request: pb.RegisterSequenceRequest, context: Any) -> pb.RegisterSequenceResponse:
        seq_id = parse.new_seq_id(request.seq_id, request.HasField("seq_id"))
        if not request.session_id:
            self.refuse_if_drained("RegisterSequence")
        identity = caller()
        check_may_share_prefixes(identity, request.public_prefix_len)
        tenant = identity.tenant_id
        with self.lock:
            key, replay = self.gate.enter(request, pb.RegisterSequenceResponse, tenant)
            if replay is not None:
                return replay
            prompt = request.prompt_token_ids
            seq_id = self.manager.register(seq_id, request.session_id, tenant, prompt if len(prompt) else None,
                                           request.public_prefix_len, request.cache_extra_key)
            cached = self.manager.num_tokens(seq_id) if len(prompt) else 0
            return self.gate.remember(key, pb.RegisterSequenceResponse(seq_id=seq_id, num_cached_tokens=cached))

    def AppendToken(self, request: pb.AppendTokenRequest, context: Any) -> pb.AppendTokenResponse:
        return append(self.manager, self.pool, self.lock, self.gate, request, pb.AppendTokenResponse,
                      max_batch=self.max_batch, rpc="AppendToken", limits=self.limits, limit=context,
                      tenant=caller().tenant_id, events=self.events)

    def Fork(self, request: pb.ForkRequest, context: Any) -> pb.ForkResponse:
        parent_seq_id = parse.seq_id(request.parent_seq_id, "Fork", "parent_seq_id")
        child_seq_ids = parse.fork_children(request.num_children, request.child_seq_ids, self.max_batch)
        num_children = max(request.num_children, len(child_seq_ids))
        self.limits.check_reply(16 + 11 * num_children, "Fork", context, 11, "children")
        self.pins.wait_unpinned((parent_seq_id,))
        tenant = caller().tenant_id
        with self.lock:
            key, replay = self.gate.enter(request, pb.ForkResponse, tenant)
            if replay is not None:
                return replay
            children = self.manager.fork(parent_seq_id, request.num_children, child_seq_ids, request.session_id,
                                         tenant)
            return self.gate.remember(key, pb.ForkResponse(child_seq_ids=children))

    def Free(self, request: pb.FreeRequest, context: Any) -> pb.FreeResponse:
        seq_ids = parse.batch_seq_ids(request.seq_ids, "Free", self.max_batch)
        if len(self.pins):
            self.pins.wait_unpinned(seq_ids.tolist())
        tenant = caller().tenant_id
        with self.lock:
            key, replay = self.gate.enter(request, pb.FreeResponse, tenant)
            if replay is not None:
                return replay
            num_freed = self.manager.free(seq_ids.tolist(), tenant)
            return self.gate.remember(key, pb.FreeResponse(num_blocks_freed=num_freed))

    # ---------------------------------------------------------------- inspection
    def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        identity = caller()
        with self.lock:
            stats = self.manager.stats()
            usage = tenant_usage(self.manager.tenants, self.sessions, None if identity.is_admin else
                                 identity.tenant_id) if self.manager.tenancy else []
        response = stats_response(stats, self.pool.layout.block_bytes)
        response.tenants.extend(usage)
        return response

    def GetBlockTable(self, request: pb.GetBlockTableRequest, context: Any) -> pb.GetBlockTableResponse:
        seq_id = parse.seq_id(request.seq_id, "GetBlockTable")
        tenant = caller().tenant_id
        with self.lock:
            block_ids = self.manager.block_table(seq_id, tenant)
            num_tokens = self.manager.num_tokens(seq_id, tenant)
            entries = self.manager.allocator.cache.entries
            hashes = [entries[b].block_hash if b in entries else b"" for b in block_ids.tolist()] if entries else []
        return pb.GetBlockTableResponse(
            block_ids=block_ids.tolist(), num_tokens=num_tokens, block_size=self.manager.block_size,
            block_hashes=hashes,
        )

    def DescribePool(self, request: pb.DescribePoolRequest, context: Any) -> pb.DescribePoolResponse:
        return describe_pool_response(self.pool, may_attach=caller().may_attach)

    def CheckInvariants(self, request: pb.CheckInvariantsRequest, context: Any) -> Offload:
        return self.invariants.request(self.lock)

    # ---------------------------------------------------------------- KV data
    def WriteKV(self, request: pb.WriteKVRequest, context: Any) -> pb.WriteKVResponse | Offload:
        tokens = self.wire.decode(request.data)
        seq_id = parse.seq_id(request.seq_id, "WriteKV")
        response = pb.WriteKVResponse(num_tokens_written=len(tokens))
        tenant = caller().tenant_id
        with self.lock:
            self.gate.enter(request, pb.WriteKVResponse, tenant)  # fencing only: a write is idempotent
            slots = self.manager.slots(seq_id, request.start_position, len(tokens), for_write=True, tenant=tenant)
            if tokens.nbytes <= INLINE_BYTES:
                self.pool.write_slots(slots, tokens)
                return response
        self.pins.pin(seq_id)

        def work() -> pb.WriteKVResponse:
            write_chunked(self.pool, slots, tokens, self.chunk_tokens)
            return response

        return Offload(work, lambda: self.pins.unpin(seq_id))

    def ReadKV(self, request: pb.ReadKVRequest, context: Any) -> pb.ReadKVResponse | Offload:
        seq_id, start = parse.seq_id(request.seq_id, "ReadKV"), request.start_position
        tenant = caller().tenant_id
        with self.lock:
            num_tokens = request.num_tokens or self.manager.num_tokens(seq_id, tenant) - start
            if request.num_tokens == 0 and num_tokens == 0:
                return pb.ReadKVResponse(data=b"", num_tokens=0)  # reading to the end, from the end
            self.wire.check_read(num_tokens)
            self.limits.check_reply(ENVELOPE_BYTES + num_tokens * self.wire.token_bytes, "ReadKV", context,
                                    self.wire.token_bytes, "tokens")
            slots = self.manager.slots(seq_id, start, num_tokens, tenant=tenant)
            if num_tokens * self.wire.token_bytes <= INLINE_BYTES:
                return pb.ReadKVResponse(data=self.wire.encode(self.pool.read_slots(slots)), num_tokens=num_tokens)
        self.pins.pin(seq_id)

        def work() -> pb.ReadKVResponse:
            out = np.empty((num_tokens, *self.wire.token_shape), dtype=self.pool.layout.storage_dtype)
            tokens = read_chunked(self.pool, slots, out, self.chunk_tokens)
            return pb.ReadKVResponse(data=self.wire.encode(tokens), num_tokens=num_tokens)

        return Offload(work, lambda: self.pins.unpin(seq_id))


@dataclass
class AppendStreamState:
    reply_limit: tuple[int, str]  # read once from the stream's metadata
    tenant: int | None  # the caller's, read once at the stream's start
    num_messages: int = 0


class AppendTokenStream:
    """AppendTokenStream as a ``streams.StreamMethod``: each message is one AppendToken (``append_rpc.append``).

    ``close`` runs whenever the stream ends (half-close, error, cancellation, a dead peer, idle timeout, shutdown);
    it has nothing to release here -- it is where a stream that owns something (a session's keep-alive) lets go.
    """

    request_cls = pb.AppendTokenStreamRequest

    def __init__(self, servicer: KVPoolServicer) -> None:
        self.servicer = servicer
        self.num_open = 0
        self.last_close_reason = ""  # for tests and logs

    def open(self, context: Any) -> AppendStreamState:
        self.num_open += 1
        return AppendStreamState(self.servicer.limits.limit(context), caller().tenant_id)

    def message(self, state: AppendStreamState, request: pb.AppendTokenStreamRequest) -> pb.AppendTokenStreamResponse:
        s = self.servicer
        state.num_messages += 1
        return append(s.manager, s.pool, s.lock, s.gate, request, pb.AppendTokenStreamResponse, max_batch=s.max_batch,
                      rpc="AppendTokenStream", limits=s.limits, limit=state.reply_limit, tenant=state.tenant,
                      events=s.events)

    def close(self, state: AppendStreamState, reason: str) -> None:
        self.num_open -= 1
        self.last_close_reason = reason
