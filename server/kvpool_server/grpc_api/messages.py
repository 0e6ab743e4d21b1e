"""The service's plain answers -> protobuf responses. Builds messages, decides nothing."""

from __future__ import annotations

import os
from typing import Any, TypeVar, cast

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.core import AppendPlan, PoolStats
from kvpool_server.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvpool_server.core.pool_figures import POOL_FIGURES
from kvpool_server.core.sessions import Session
from kvpool_server.offload.tier_pool import CopyTotals
from kvpool_server.offload.tier_stats import TIER_FIGURES, TierFigure
from kvpool_server.service.kvpool import PoolDescription, RankShard
from kvpool_server.service.tenant_usage import TenantUsage

DTYPE_TO_PB = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16, "bfloat16": pb.DTYPE_BFLOAT16}
BACKEND_TO_PB = {"gpu": pb.BACKEND_GPU, "host": pb.BACKEND_HOST}
R = TypeVar("R")


def append_response(plan: AppendPlan, response_cls: type[R]) -> R:
    """An AppendTokenResponse or AppendTokenStreamResponse (the same fields) of ``plan``."""
    message_cls: Any = response_cls
    response = message_cls(slot_mapping=plan.slot_mapping.tolist(), new_block_ids=plan.new_block_ids.tolist())
    if plan.copies.shape[0]:
        response.copies.extend(pb.BlockCopy(src_block_id=s, dst_block_id=d) for s, d in plan.copies.tolist())
    return response


def stats_response(stats: PoolStats, block_bytes: int, copies: CopyTotals | None = None) -> pb.StatsResponse:
    """The pool's stats; ``host_tier`` set when the pool has a host tier (``copies``: its copy totals)."""
    fields: dict[str, Any] = {f.name: getattr(stats, f.name) for f in POOL_FIGURES}  # core/pool_figures.py
    response = pb.StatsResponse(block_bytes=block_bytes, **fields)
    if stats.host_tier_blocks_total:
        response.host_tier.CopyFrom(host_tier_stats(stats, block_bytes, copies or CopyTotals()))
    return response


def host_tier_stats(s: PoolStats, block_bytes: int, copies: CopyTotals) -> pb.HostTierStats:
    """StatsResponse.host_tier: each field as its declaration says (offload/tier_stats.py)."""
    fields: dict[str, Any] = {f.proto: _figure(f, s, block_bytes, copies) for f in TIER_FIGURES if f.proto}
    return pb.HostTierStats(**fields)


def _figure(f: TierFigure, s: PoolStats, block_bytes: int, copies: CopyTotals) -> Any:
    if f.copies:
        return getattr(copies, f.copies)
    if f.per_block:
        return getattr(s, f.per_block) * block_bytes
    return getattr(s, f.stat)


def stats_with_tenants(answer: tuple[PoolStats, list[TenantUsage]], block_bytes: int,
                       copies: CopyTotals | None = None) -> pb.StatsResponse:
    stats, usage = answer
    response = stats_response(stats, block_bytes, copies)
    response.tenants.extend(pb.TenantUsage(
        tenant=u.tenant, num_sequences=u.num_sequences, num_blocks=u.num_blocks, num_sessions=u.num_sessions,
        max_blocks=u.max_blocks, max_sequences=u.max_sequences, max_sessions=u.max_sessions,
        reserved_blocks=u.reserved_blocks) for u in usage)
    return response


def ms(seconds: float) -> int:
    return max(0, min(2**32 - 1, round(seconds * 1000)))


def session_info(session: Session, remaining_s: float, num_sequences: int, num_blocks: int) -> pb.SessionInfo:
    return pb.SessionInfo(
        session_id=session.session_id, client_name=session.client_name, opened_unix_ms=session.opened_unix_ms,
        lease_ttl_ms=ms(session.lease_ttl_s), lease_remaining_ms=ms(remaining_s),
        keep_alive_open=session.num_keep_alive_streams > 0, num_sequences=num_sequences, num_blocks=num_blocks,
    )


def describe_pool_response(pool: PoolDescription) -> pb.DescribePoolResponse:
    """The pool's layout; with ``may_attach``, also what maps it (shm name, CUDA IPC handle): mapping the pool
    gives every byte of every tenant's KV (docs/security.md)."""
    layout, info, may_attach = pool.layout, pool.attach, pool.may_attach
    return pb.DescribePoolResponse(
        layout=pb.PoolLayout(
            num_blocks=pool.num_blocks,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            block_size=layout.block_size,
            dtype=DTYPE_TO_PB[layout.dtype],
            block_bytes=layout.block_bytes,
            token_bytes=layout.token_bytes,
            kv_layout=cast(Any, pb.KvLayout.Value("KV_LAYOUT_" + layout.kv_layout.upper().replace("-", "_"))),
        ),
        backend=BACKEND_TO_PB[info.backend],
        pool_bytes=info.pool_bytes,
        cuda_ipc_handle=bytes(info.cuda_ipc_handle or b"") if may_attach else b"",
        cuda_device=info.cuda_device if info.cuda_device is not None else 0,
        shm_name=(info.shm_name or "") if may_attach else "",
        server_pid=os.getpid(),
        tensor_parallel=pool.tensor_parallel,
        shards=[pool_shard(shard, may_attach) for shard in pool.shards],
    )


def pool_shard(shard: RankShard, may_attach: bool) -> pb.PoolShard:
    """One rank's shard: its heads, and (with ``may_attach``) what maps it."""
    info = shard.attach
    return pb.PoolShard(
        rank=shard.rank, first_kv_head=shard.heads.start, num_kv_heads=len(shard.heads), pool_bytes=info.pool_bytes,
        block_bytes=shard.layout.block_bytes,
        cuda_ipc_handle=bytes(info.cuda_ipc_handle or b"") if may_attach else b"",
        cuda_device=info.cuda_device if info.cuda_device is not None else 0,
        shm_name=(info.shm_name or "") if may_attach else "",
    )


def batch_message(batch: EventBatch, num_dropped: int, medium: str = "") -> pb.SubscribeEventsResponse:
    events = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(pb.KVEvent(block_stored=pb.BlockStored(
                block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash or b"",
                token_ids=event.token_ids, block_size=event.block_size, cache_extra_key=event.cache_extra_key,
                medium=event.medium or medium)))  # "CPU": the host tier's; else the pool's
        elif isinstance(event, BlockRemoved):
            events.append(pb.KVEvent(block_removed=pb.BlockRemoved(block_hashes=event.block_hashes,
                                                                          medium=event.medium or medium)))
        elif isinstance(event, AllBlocksCleared):
            events.append(pb.KVEvent(all_blocks_cleared=pb.AllBlocksCleared()))
    return pb.SubscribeEventsResponse(epoch=batch.epoch, seq=batch.seq, events=events, snapshot=batch.snapshot,
                                      num_dropped=num_dropped)
