"""KVPoolServicer: protobuf <-> core, nothing else.

Each method reads: validate the request -> call the core (and the pool) under one lock -> build the response.
The core raises before it changes anything and the servicer validates before it calls the core, so a failed call
leaves the pool exactly as it was; kvpool_server/errors.py turns the raised error into the status code.

One ``threading.Lock`` covers the manager *and* the pool: a WriteKV resolves slots and writes them under the same
hold, so a concurrent Free cannot hand those blocks to another sequence in between, and an AppendToken runs its
copy-on-write copies (``pool.copy_blocks``) before anyone can see the new slots.

AppendTokenStream is AppendToken message by message (``stream_rpc``): the request -> plan -> response path is the
same code, ``append_rpc.append``.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_server.append_rpc import append, check_no_zero
from kvpool_server.core import InvalidArgumentError, KVCacheManager
from kvpool_server.errors import ServerShuttingDownError, abort

DTYPE_TO_PB = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16, "bfloat16": pb.DTYPE_BFLOAT16}
BACKEND_TO_PB = {"gpu": pb.BACKEND_GPU, "host": pb.BACKEND_HOST}
# Room for the response envelope around ReadKV's data.
_ENVELOPE_BYTES = 1024
F = TypeVar("F", bound=Callable[..., Any])


def rpc(method: F) -> F:
    """A servicer method: refused with UNAVAILABLE while draining; any raised error ends the call with its status."""

    @functools.wraps(method)
    def wrapper(self: KVPoolServicer, request: Any, context: Any) -> Any:
        try:
            self._admit()
            return method(self, request, context)
        except Exception as exc:
            abort(context, exc, method.__name__)
        finally:
            self._release()

    return wrapper  # type: ignore[return-value]


def stream_rpc(method: F) -> F:
    """A bidirectional stream of ``method`` calls: each request answered by one response, in order.

    Each message is admitted like a unary call: counted in flight -- until its response has been sent -- and
    refused with UNAVAILABLE while draining. A stream waiting for the client's next message is not in flight, so
    an idle stream does not hold up shutdown. Once draining, the stream ends with UNAVAILABLE at the next message
    boundary (right after the response in progress is sent). A raised error ends the stream with its status: the
    messages before were applied, the failing one changed nothing, later ones are never read.
    """

    @functools.wraps(method)
    def wrapper(self: KVPoolServicer, requests: Iterator[Any], context: Any) -> Iterator[Any]:
        admitted = False  # a message is in flight: counted until its response is sent and the next one is due
        try:
            while True:
                if self.draining:
                    self._refuse()  # still counted: the status goes out before shutdown stops the server
                if admitted:
                    admitted = False
                    self._release()
                try:
                    request = next(requests)
                except StopIteration:
                    return  # the client half-closed: every message was answered; OK
                except grpc.RpcError:
                    return  # cancelled by the client (or its deadline passed): nobody to answer
                admitted = True  # before _admit, which counts and then may refuse
                self._admit()
                yield method(self, request, context)  # resumed once gRPC has sent the response
        except Exception as exc:
            abort(context, exc, method.__name__)
        finally:
            if admitted:
                self._release()

    return wrapper  # type: ignore[return-value]


class KVPoolServicer(pb_grpc.KVPoolServiceServicer):
    """The KVPoolService RPCs over one KVCacheManager and one KVPool (see docs/api.md)."""

    def __init__(self, manager: KVCacheManager, pool: Any, *, max_batch: int, max_message_bytes: int) -> None:
        self.manager = manager
        self.pool = pool
        self.max_batch = max_batch
        self.lock = threading.Lock()
        # Shutdown state (see main.shutdown): once draining, new calls are refused with UNAVAILABLE.
        self.draining = False
        self.last_refused_at = 0.0
        self.num_in_flight = 0  # calls (and AppendTokenStream messages) in progress now
        self._in_flight_lock = threading.Lock()
        layout = pool.layout
        self._token_bytes: int = layout.token_bytes
        self._token_shape: tuple[int, ...] = layout.token_shape
        self._wire_dtype: np.dtype = layout.storage_dtype.newbyteorder("<")
        self._max_read_tokens: int = max(1, (max_message_bytes - _ENVELOPE_BYTES) // self._token_bytes)

    # ---------------------------------------------------------------- sequences
    @rpc
    def RegisterSequence(self, request: pb.RegisterSequenceRequest, context: Any) -> pb.RegisterSequenceResponse:
        seq_id = request.seq_id if request.HasField("seq_id") else None
        with self.lock:
            seq_id = self.manager.register(seq_id)
        return pb.RegisterSequenceResponse(seq_id=seq_id)

    @rpc
    def AppendToken(self, request: pb.AppendTokenRequest, context: Any) -> pb.AppendTokenResponse:
        return append(self, request, pb.AppendTokenResponse, "AppendToken")

    @stream_rpc
    def AppendTokenStream(
        self, request: pb.AppendTokenStreamRequest, context: Any
    ) -> pb.AppendTokenStreamResponse:
        return append(self, request, pb.AppendTokenStreamResponse, "AppendTokenStream")

    @rpc
    def Fork(self, request: pb.ForkRequest, context: Any) -> pb.ForkResponse:
        parent_seq_id = _seq_id(request.parent_seq_id, "parent_seq_id")
        child_seq_ids = list(request.child_seq_ids)
        num_children = max(request.num_children, len(child_seq_ids))
        if num_children > self.max_batch:
            raise InvalidArgumentError(f"Fork makes at most max_batch={self.max_batch} children, asked {num_children}")
        with self.lock:
            children = self.manager.fork(parent_seq_id, request.num_children, child_seq_ids)
        return pb.ForkResponse(child_seq_ids=children)

    @rpc
    def Free(self, request: pb.FreeRequest, context: Any) -> pb.FreeResponse:
        seq_ids = self.batch_ids(request.seq_ids, "Free")
        check_no_zero(seq_ids, "Free")
        with self.lock:
            num_freed = self.manager.free(seq_ids.tolist())
        return pb.FreeResponse(num_blocks_freed=num_freed)

    # ---------------------------------------------------------------- inspection
    @rpc
    def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        with self.lock:
            stats = self.manager.stats()
        return pb.StatsResponse(
            num_blocks_total=stats.num_blocks_total,
            num_blocks_free=stats.num_blocks_free,
            num_blocks_used=stats.num_blocks_used,
            utilization=stats.utilization,
            num_tokens=stats.num_tokens,
            num_slots_unused=stats.num_slots_unused,
            internal_fragmentation=stats.internal_fragmentation,
            num_blocks_shared=stats.num_blocks_shared,
            num_copies=stats.num_copies,
            num_sequences=stats.num_sequences,
            block_size=stats.block_size,
            block_bytes=self.pool.layout.block_bytes,
        )

    @rpc
    def GetBlockTable(self, request: pb.GetBlockTableRequest, context: Any) -> pb.GetBlockTableResponse:
        seq_id = _seq_id(request.seq_id)
        with self.lock:
            block_ids = self.manager.block_table(seq_id)
            num_tokens = self.manager.num_tokens(seq_id)
        return pb.GetBlockTableResponse(
            block_ids=block_ids.tolist(), num_tokens=num_tokens, block_size=self.manager.block_size
        )

    @rpc
    def DescribePool(self, request: pb.DescribePoolRequest, context: Any) -> pb.DescribePoolResponse:
        layout, info = self.pool.layout, self.pool.attach_info()
        return pb.DescribePoolResponse(
            layout=pb.PoolLayout(
                num_blocks=self.pool.num_blocks,
                num_layers=layout.num_layers,
                num_kv_heads=layout.num_kv_heads,
                head_dim=layout.head_dim,
                block_size=layout.block_size,
                dtype=DTYPE_TO_PB[layout.dtype],
                block_bytes=layout.block_bytes,
                token_bytes=layout.token_bytes,
                kv_layout=pb.KvLayout.Value("KV_LAYOUT_" + layout.kv_layout.upper().replace("-", "_")),
            ),
            backend=BACKEND_TO_PB[info.backend],
            pool_bytes=info.pool_bytes,
            cuda_ipc_handle=bytes(info.cuda_ipc_handle or b""),
            cuda_device=info.cuda_device if info.cuda_device is not None else 0,
            shm_name=info.shm_name or "",
            server_pid=os.getpid(),
        )

    @rpc
    def CheckInvariants(self, request: pb.CheckInvariantsRequest, context: Any) -> pb.CheckInvariantsResponse:
        with self.lock:
            self.manager.check_invariants()
            num_sequences = self.manager.num_sequences
        return pb.CheckInvariantsResponse(
            ok=True, num_blocks_checked=self.manager.num_blocks, num_sequences_checked=num_sequences
        )

    # ---------------------------------------------------------------- KV data
    @rpc
    def WriteKV(self, request: pb.WriteKVRequest, context: Any) -> pb.WriteKVResponse:
        num_tokens, remainder = divmod(len(request.data), self._token_bytes)
        if remainder or num_tokens == 0:
            raise InvalidArgumentError(
                f"WriteKV data is {len(request.data)} bytes; it must be a positive multiple of "
                f"token_bytes={self._token_bytes}"
            )
        seq_id = _seq_id(request.seq_id)
        data = np.frombuffer(request.data, dtype=self._wire_dtype).reshape((num_tokens, *self._token_shape))
        with self.lock:
            slots = self.manager.slots(seq_id, request.start_position, num_tokens, for_write=True)
            self.pool.write_slots(slots, data)
        return pb.WriteKVResponse(num_tokens_written=num_tokens)

    @rpc
    def ReadKV(self, request: pb.ReadKVRequest, context: Any) -> pb.ReadKVResponse:
        seq_id, start = _seq_id(request.seq_id), request.start_position
        with self.lock:
            num_tokens = request.num_tokens or self.manager.num_tokens(seq_id) - start
            if request.num_tokens == 0 and num_tokens == 0:
                return pb.ReadKVResponse(data=b"", num_tokens=0)  # reading to the end, from the end
            if num_tokens > self._max_read_tokens:
                raise InvalidArgumentError(
                    f"ReadKV of {num_tokens} tokens exceeds the message limit; read at most "
                    f"{self._max_read_tokens} tokens per call"
                )
            slots = self.manager.slots(seq_id, start, num_tokens)
            data = self.pool.read_slots(slots)
        wire = np.ascontiguousarray(data, dtype=self._wire_dtype)
        return pb.ReadKVResponse(data=wire.tobytes(), num_tokens=num_tokens)

    # ---------------------------------------------------------------- helpers
    def _admit(self) -> None:
        """Count one call (or stream message) in flight -- the caller must _release() it, even when this raises --
        and refuse it with UNAVAILABLE while draining."""
        with self._in_flight_lock:
            self.num_in_flight += 1
        if self.draining:
            self._refuse()

    def _release(self) -> None:
        with self._in_flight_lock:
            self.num_in_flight -= 1

    def _refuse(self) -> None:
        self.last_refused_at = time.monotonic()
        raise ServerShuttingDownError("kvpool-server is shutting down and takes no new calls")

    def batch_ids(self, seq_ids: Any, rpc: str) -> np.ndarray:
        """Repeated seq_ids -> uint64 array, checked: non-empty and at most max_batch ids."""
        if len(seq_ids) == 0:
            raise InvalidArgumentError(f"{rpc} needs at least one seq_id")
        if len(seq_ids) > self.max_batch:
            raise InvalidArgumentError(f"{rpc} takes at most max_batch={self.max_batch} seq_ids, got {len(seq_ids)}")
        return np.array(seq_ids, dtype=np.uint64)


def _seq_id(seq_id: int, field: str = "seq_id") -> int:
    """A single id field: 0 is proto3's unset value, never a sequence."""
    if seq_id == 0:
        raise InvalidArgumentError(f"{field} is required (0 means unset)")
    return seq_id
