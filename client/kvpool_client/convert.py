"""Requests in, types.py out: the argument checks, request building and response parsing of every call, pure
functions with no I/O. The commands (commands.py, which both clients inherit) and AppendStream (stream.py) use
them, so every path refuses the same bad arguments before sending and returns the same values."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client.errors import InvalidArgumentError
from kvpool.layout import KVLayout
from kvpool_client.types import (
    AppendResult,
    BlockTable,
    HostTierStats,
    InvariantReport,
    PoolDescription,
    PoolShard,
    PoolStats,
    RegisteredSequence,
    SequenceInfo,
    SessionInfo,
    TenantUsage,
)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
DTYPE_NAMES = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_FLOAT16: "float16", pb.DTYPE_BFLOAT16: "bfloat16"}
BACKEND_NAMES = {pb.BACKEND_GPU: "gpu", pb.BACKEND_HOST: "host"}


def channel_options(options: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """Message limits large enough for ReadKV / WriteKV of long sequences, then the caller's options."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        *options,
    ]


QUOTAS = ("max_blocks", "max_sequences", "max_sessions")  # TenantUsage fields with presence: unset = no limit
RECEIVE_LIMIT_KEY = "kvpool-max-receive-bytes"  # the server refuses a mutation whose reply could exceed this


def call_metadata(options: Sequence[tuple[str, Any]]) -> tuple[tuple[str, str], ...]:
    """The metadata every call carries: this channel's receive limit (the last ``grpc.max_receive_message_length``
    of ``options``), so that the server refuses -- unapplied -- a mutation whose reply this client could not take."""
    limit = MAX_MESSAGE_BYTES
    for key, value in options:
        if key == "grpc.max_receive_message_length":
            limit = int(value)
    return ((RECEIVE_LIMIT_KEY, str(limit if limit >= 0 else -1)),)


def _pem(value: str | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def channel_credentials(tls_ca: str | bytes | None, tls_cert: str | bytes | None,
                        tls_key: str | bytes | None) -> grpc.ChannelCredentials | None:
    """TLS credentials (None: a plaintext channel). Each argument is PEM bytes or a path to a PEM file."""
    if tls_ca is None and tls_cert is None:
        return None
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key go together (mutual TLS)")
    return grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca), private_key=_pem(tls_key),
                                        certificate_chain=_pem(tls_cert))


def seq_id_list(seq_ids: int | Sequence[int] | np.ndarray) -> list[int]:
    return [int(seq_ids)] if isinstance(seq_ids, (int, np.integer)) else [int(s) for s in seq_ids]


# ---------------------------------------------------------------- sequences
def register_request(seq_id: int | None, *, public_prefix_len: int = 0, cache_extra_key: bytes = b"",
                     **session: int) -> pb.RegisterSequenceRequest:
    """``session``: session_id and request_id (commands._session_fields), or nothing. A negative
    ``public_prefix_len`` is InvalidArgumentError before anything is sent (the field is unsigned)."""
    if public_prefix_len < 0:
        raise InvalidArgumentError(f"public_prefix_len must be >= 0, got {public_prefix_len}")
    request = pb.RegisterSequenceRequest(public_prefix_len=public_prefix_len, cache_extra_key=cache_extra_key,
                                         **session)
    if seq_id is not None:
        request.seq_id = seq_id
    return request


def register_many_request(prompts: Sequence[Sequence[int] | np.ndarray], cache_extra_keys: Sequence[bytes],
                          **session: int) -> pb.RegisterSequencesRequest:
    """One SequencePrompt per prompt, its key ``cache_extra_keys[i]`` (or none at all: b"" each)."""
    if cache_extra_keys and len(cache_extra_keys) != len(prompts):
        raise InvalidArgumentError(f"{len(cache_extra_keys)} cache_extra_keys for {len(prompts)} prompts: give one "
                                   "per prompt, or none")
    keys = cache_extra_keys or [b""] * len(prompts)
    return pb.RegisterSequencesRequest(prompts=[
        pb.SequencePrompt(prompt_token_ids=np.asarray(p, dtype=np.uint32).tolist(), cache_extra_key=k)
        for p, k in zip(prompts, keys)], **session)


def registered_sequences(response: pb.RegisterSequencesResponse) -> list[RegisteredSequence]:
    return [RegisteredSequence(s.seq_id, s.num_cached_tokens, np.asarray(s.cached_block_ids, dtype=np.int32))
            for s in response.sequences]


def append_args(
    seq_ids: int | Sequence[int] | np.ndarray, num_tokens: int | Sequence[int] | np.ndarray, method: str
) -> tuple[list[int], np.ndarray, list[int]]:
    """(ids, one count per id, the request's num_tokens field); InvalidArgumentError before anything is sent."""
    ids = seq_id_list(seq_ids)
    if isinstance(num_tokens, (int, np.integer)):
        counts_field = [int(num_tokens)]
        counts = np.full(len(ids), int(num_tokens), dtype=np.int64)
    else:
        counts = np.asarray(num_tokens, dtype=np.int64)
        counts_field = counts.tolist()
    if counts.size != len(ids) or (counts < 1).any():
        raise InvalidArgumentError(
            f"need one num_tokens >= 1 for all, or one per sequence; got {counts.tolist()} for {len(ids)}",
            method=method,
        )
    return ids, counts, counts_field


def append_result(ids: list[int], counts: np.ndarray, response: Any) -> AppendResult:
    """An AppendTokenResponse or AppendTokenStreamResponse (the same fields) as an AppendResult."""
    copies = np.array([(c.src_block_id, c.dst_block_id) for c in response.copies], dtype=np.int64).reshape(-1, 2)
    return AppendResult(
        seq_ids=tuple(ids),
        num_tokens=counts,
        slot_mapping=np.array(response.slot_mapping, dtype=np.int64),
        new_block_ids=np.array(response.new_block_ids, dtype=np.int64),
        copies=copies,
    )


def fork_request(parent_seq_id: int, num_children: int, child_seq_ids: Sequence[int], **session: int) -> pb.ForkRequest:
    return pb.ForkRequest(parent_seq_id=parent_seq_id, num_children=num_children, child_seq_ids=child_seq_ids,
                          **session)


def free_request(seq_ids: int | Sequence[int] | np.ndarray, **session: int) -> pb.FreeRequest:
    return pb.FreeRequest(seq_ids=seq_id_list(seq_ids), **session)


# ---------------------------------------------------------------- sessions
def session_info(r: pb.SessionInfo) -> SessionInfo:
    return SessionInfo(**{f.name: getattr(r, f.name) for f in fields(SessionInfo)})


def sequence_info(r: pb.SequenceInfo) -> SequenceInfo:
    return SequenceInfo(**{f.name: getattr(r, f.name) for f in fields(SequenceInfo)})


# ---------------------------------------------------------------- reads
def pool_stats(r: pb.StatsResponse) -> PoolStats:
    tenants = tuple(TenantUsage(**{f.name: getattr(t, f.name) if f.name not in QUOTAS or t.HasField(f.name) else None
                                   for f in fields(TenantUsage)}) for t in r.tenants)
    tier = HostTierStats(**{f.name: getattr(r.host_tier, f.name) for f in fields(HostTierStats)}) \
        if r.HasField("host_tier") else None
    return PoolStats(**{f.name: getattr(r, f.name) for f in fields(PoolStats) if f.name not in ("tenants", "host_tier")},
                     tenants=tenants, host_tier=tier)


def block_table(r: pb.GetBlockTableResponse) -> BlockTable:
    return BlockTable(np.array(r.block_ids, dtype=np.int64), r.num_tokens, r.block_size)


def pool_description(r: pb.DescribePoolResponse) -> PoolDescription:
    lay = r.layout
    layout = KVLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, DTYPE_NAMES[lay.dtype],
                      "layer-major" if lay.kv_layout == pb.KV_LAYOUT_LAYER_MAJOR else "block-major")
    shards = tuple(
        PoolShard(rank=s.rank, heads=range(s.first_kv_head, s.first_kv_head + s.num_kv_heads),
                  layout=dataclasses.replace(layout, num_kv_heads=s.num_kv_heads), pool_bytes=s.pool_bytes,
                  shm_name=s.shm_name, cuda_ipc_handle=bytes(s.cuda_ipc_handle), cuda_device=s.cuda_device)
        for s in r.shards
    ) or (PoolShard(0, range(layout.num_kv_heads), layout, r.pool_bytes, r.shm_name, bytes(r.cuda_ipc_handle),
                    r.cuda_device),)  # a server before tensor parallelism: one pool, rank 0
    return PoolDescription(
        layout=layout,
        num_blocks=lay.num_blocks,
        backend=BACKEND_NAMES.get(r.backend, "unspecified"),
        pool_bytes=r.pool_bytes,
        block_bytes=lay.block_bytes,
        token_bytes=lay.token_bytes,
        shm_name=r.shm_name,
        cuda_ipc_handle=bytes(r.cuda_ipc_handle),
        cuda_device=r.cuda_device,
        server_pid=r.server_pid,
        tensor_parallel=max(1, r.tensor_parallel),
        shards=shards,
    )


def invariant_report(r: pb.CheckInvariantsResponse) -> InvariantReport:
    return InvariantReport(r.ok, r.num_blocks_checked, r.num_sequences_checked)


def health_request(service: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def health_status(r: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


# ---------------------------------------------------------------- KV through the page table
def read_kv_request(seq_id: int, start: int, num_tokens: int) -> pb.ReadKVRequest:
    return pb.ReadKVRequest(seq_id=seq_id, start_position=start, num_tokens=num_tokens)


def kv_array(r: pb.ReadKVResponse, layout: KVLayout) -> np.ndarray:
    """ReadKV's little-endian bytes as [n, num_layers, 2, num_kv_heads, head_dim] in the pool's storage dtype."""
    wire = layout.storage_dtype.newbyteorder("<")
    return np.frombuffer(r.data, dtype=wire).reshape((r.num_tokens, *layout.token_shape)).astype(layout.storage_dtype)


def write_kv_request(
    seq_id: int, start: int, data: np.ndarray, layout: KVLayout, session_id: int = 0
) -> pb.WriteKVRequest:
    """Checks shape and dtype (InvalidArgumentError before sending) and packs ``data`` little-endian."""
    data = np.asarray(data)
    if data.ndim != 5 or data.shape[1:] != layout.token_shape:
        raise InvalidArgumentError(f"data must be [n, *{layout.token_shape}], got {data.shape}", method="WriteKV")
    if data.dtype != layout.storage_dtype:
        raise InvalidArgumentError(f"data must be {layout.storage_dtype}, got {data.dtype}", method="WriteKV")
    payload = np.ascontiguousarray(data, dtype=layout.storage_dtype.newbyteorder("<")).tobytes()
    return pb.WriteKVRequest(seq_id=seq_id, start_position=start, data=payload, session_id=session_id)
