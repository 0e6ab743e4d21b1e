"""KVPoolServicer: protobuf <-> core, nothing else.

Each method reads: parse the request (``parse``) -> call the core (and the pool) under one lock -> build the
response (``responses``). The servicer checks before it calls the core and the core raises before it changes
anything, so a failed call leaves the pool exactly as it was; ``rpc_wrappers`` admit the call through the
``Drain`` and hand a raised error to ``errors``, which picks the status code.

One ``threading.Lock`` covers the manager *and* the pool: a WriteKV resolves slots and writes them under the same
hold, so a concurrent Free cannot hand those blocks to another sequence in between, and an AppendToken runs its
copy-on-write copies (``pool.copy_blocks``) before anyone can see the new slots.

AppendTokenStream is AppendToken message by message (``stream_rpc``): the request -> plan -> response path is the
same code, ``append_rpc.append``.

Every mutating call passes the ``SessionGate`` first, under the lock: the session it names must be live (fencing),
and a repeated request id gets its first answer (safe retries). The session RPCs are ``session_rpcs.SessionRpcs``.
"""

from __future__ import annotations

import threading

from grpc import ServicerContext

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_server import parse
from kvpool_server.append_rpc import append
from kvpool_server.core import KVCacheManager
from kvpool_server.core.sessions import SessionTable
from kvpool_server.drain import Drain
from kvpool_server.kv_wire import KVWire
from kvpool_server.pool_protocol import Pool
from kvpool_server.replies import ReplyCache
from kvpool_server.responses import describe_pool_response, stats_response
from kvpool_server.rpc_wrappers import keep_alive_rpc, rpc, stream_rpc
from kvpool_server.session_gate import SessionGate
from kvpool_server.session_rpcs import SessionRpcs


def _no_metrics(reason: str, latency_s: float, num_sequences: int, num_blocks: int) -> None:
    pass


class KVPoolServicer(SessionRpcs, pb_grpc.KVPoolServiceServicer):
    """The KVPoolService RPCs over one KVCacheManager and one pool (see docs/api.md)."""

    def __init__(
        self,
        manager: KVCacheManager,
        pool: Pool,
        drain: Drain,
        sessions: SessionTable,
        *,
        max_batch: int,
        max_message_bytes: int,
    ) -> None:
        self.manager = manager
        self.pool = pool
        self.drain = drain
        self.lock = threading.Lock()
        self.max_batch = max_batch
        self.wire = KVWire(pool.layout, max_message_bytes)
        self.sessions = sessions
        self.replies = ReplyCache()
        self.gate = SessionGate(sessions, self.replies)
        self.on_session_end = _no_metrics  # metrics.session_reclaimed, when metrics are on

    # ---------------------------------------------------------------- sequences
    @rpc
    def RegisterSequence(
        self, request: pb.RegisterSequenceRequest, context: ServicerContext
    ) -> pb.RegisterSequenceResponse:
        seq_id = parse.new_seq_id(request.seq_id, request.HasField("seq_id"))
        with self.lock:
            key, replay = self.gate.enter(request, pb.RegisterSequenceResponse)
            if replay is not None:
                return replay
            seq_id = self.manager.register(seq_id, request.session_id)
            return self.gate.remember(key, pb.RegisterSequenceResponse(seq_id=seq_id))

    @rpc
    def AppendToken(self, request: pb.AppendTokenRequest, context: ServicerContext) -> pb.AppendTokenResponse:
        return append(self.manager, self.pool, self.lock, self.gate, request, pb.AppendTokenResponse,
                      max_batch=self.max_batch, rpc="AppendToken")

    @stream_rpc
    def AppendTokenStream(
        self, request: pb.AppendTokenStreamRequest, context: ServicerContext
    ) -> pb.AppendTokenStreamResponse:
        return append(self.manager, self.pool, self.lock, self.gate, request, pb.AppendTokenStreamResponse,
                      max_batch=self.max_batch, rpc="AppendTokenStream")

    @rpc
    def Fork(self, request: pb.ForkRequest, context: ServicerContext) -> pb.ForkResponse:
        parent_seq_id = parse.seq_id(request.parent_seq_id, "Fork", "parent_seq_id")
        child_seq_ids = parse.fork_children(request.num_children, request.child_seq_ids, self.max_batch)
        with self.lock:
            key, replay = self.gate.enter(request, pb.ForkResponse)
            if replay is not None:
                return replay
            children = self.manager.fork(parent_seq_id, request.num_children, child_seq_ids, request.session_id)
            return self.gate.remember(key, pb.ForkResponse(child_seq_ids=children))

    @rpc
    def Free(self, request: pb.FreeRequest, context: ServicerContext) -> pb.FreeResponse:
        seq_ids = parse.batch_seq_ids(request.seq_ids, "Free", self.max_batch)
        with self.lock:
            key, replay = self.gate.enter(request, pb.FreeResponse)
            if replay is not None:
                return replay
            num_freed = self.manager.free(seq_ids.tolist())
            return self.gate.remember(key, pb.FreeResponse(num_blocks_freed=num_freed))

    # ---------------------------------------------------------------- inspection
    @rpc
    def Stats(self, request: pb.StatsRequest, context: ServicerContext) -> pb.StatsResponse:
        with self.lock:
            stats = self.manager.stats()
        return stats_response(stats, self.pool.layout.block_bytes)

    @rpc
    def GetBlockTable(self, request: pb.GetBlockTableRequest, context: ServicerContext) -> pb.GetBlockTableResponse:
        seq_id = parse.seq_id(request.seq_id, "GetBlockTable")
        with self.lock:
            block_ids = self.manager.block_table(seq_id)
            num_tokens = self.manager.num_tokens(seq_id)
        return pb.GetBlockTableResponse(
            block_ids=block_ids.tolist(), num_tokens=num_tokens, block_size=self.manager.block_size
        )

    @rpc
    def DescribePool(self, request: pb.DescribePoolRequest, context: ServicerContext) -> pb.DescribePoolResponse:
        return describe_pool_response(self.pool)

    @rpc
    def CheckInvariants(
        self, request: pb.CheckInvariantsRequest, context: ServicerContext
    ) -> pb.CheckInvariantsResponse:
        with self.lock:
            self.manager.check_invariants()
            num_sequences = self.manager.num_sequences
        return pb.CheckInvariantsResponse(
            ok=True, num_blocks_checked=self.manager.num_blocks, num_sequences_checked=num_sequences
        )

    # ---------------------------------------------------------------- KV data
    @rpc
    def WriteKV(self, request: pb.WriteKVRequest, context: ServicerContext) -> pb.WriteKVResponse:
        tokens = self.wire.decode(request.data)
        seq_id = parse.seq_id(request.seq_id, "WriteKV")
        with self.lock:
            self.gate.enter(request, pb.WriteKVResponse)  # fencing only: a write is idempotent
            slots = self.manager.slots(seq_id, request.start_position, len(tokens), for_write=True)
            self.pool.write_slots(slots, tokens)
        return pb.WriteKVResponse(num_tokens_written=len(tokens))

    @rpc
    def ReadKV(self, request: pb.ReadKVRequest, context: ServicerContext) -> pb.ReadKVResponse:
        seq_id, start = parse.seq_id(request.seq_id, "ReadKV"), request.start_position
        with self.lock:
            num_tokens = request.num_tokens or self.manager.num_tokens(seq_id) - start
            if request.num_tokens == 0 and num_tokens == 0:
                return pb.ReadKVResponse(data=b"", num_tokens=0)  # reading to the end, from the end
            self.wire.check_read(num_tokens)
            tokens = self.pool.read_slots(self.manager.slots(seq_id, start, num_tokens))
        return pb.ReadKVResponse(data=self.wire.encode(tokens), num_tokens=num_tokens)

    # ---------------------------------------------------------------- sessions (session_rpcs.py)
    @rpc
    def OpenSession(self, request: pb.OpenSessionRequest, context: ServicerContext) -> pb.OpenSessionResponse:
        return self.open_session(request)

    @keep_alive_rpc
    def KeepAlive(self, state: dict, request: pb.KeepAliveRequest, context: ServicerContext) -> pb.KeepAliveResponse:
        return self.keep_alive_message(state, request)

    @rpc
    def CloseSession(self, request: pb.CloseSessionRequest, context: ServicerContext) -> pb.CloseSessionResponse:
        return self.close_session(request)

    @rpc
    def ListSessions(self, request: pb.ListSessionsRequest, context: ServicerContext) -> pb.ListSessionsResponse:
        return self.list_sessions(request)

    @rpc
    def ListSequences(self, request: pb.ListSequencesRequest, context: ServicerContext) -> pb.ListSequencesResponse:
        return self.list_sequences(request)
