"""The core's results (and the pool's description) -> protobuf responses. Builds messages, decides nothing."""

from __future__ import annotations

import os
from typing import Any, TypeVar

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.core import AppendPlan, PoolStats
from kvpool_server.core.sessions import SessionTable
from kvpool_server.core.tenants import TenantLedger
from kvpool_server.pool_protocol import Pool

DTYPE_TO_PB = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16, "bfloat16": pb.DTYPE_BFLOAT16}
BACKEND_TO_PB = {"gpu": pb.BACKEND_GPU, "host": pb.BACKEND_HOST}
R = TypeVar("R")


def append_response(plan: AppendPlan, response_cls: type[R]) -> R:
    """An AppendTokenResponse or AppendTokenStreamResponse (the same fields) of ``plan``."""
    message_cls: Any = response_cls
    response = message_cls(slot_mapping=plan.slot_mapping.tolist(), new_block_ids=plan.new_block_ids.tolist())
    if plan.copies.shape[0]:
        response.copies.extend(pb.BlockCopy(src_block_id=s, dst_block_id=d) for s, d in plan.copies.tolist())
    return response  # type: ignore[no-any-return]


def stats_response(stats: PoolStats, block_bytes: int) -> pb.StatsResponse:
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
        block_bytes=block_bytes,
        num_blocks_evictable=stats.num_blocks_evictable,
    )


def tenant_usage(ledger: TenantLedger, sessions: SessionTable, tenant: int | None) -> list[pb.TenantUsage]:
    """Every tenant's usage and quotas (``tenant`` None), or one tenant's."""
    ids = range(1, len(ledger.names)) if tenant is None else [tenant]
    usage = []
    for t in ids:
        lim = ledger.limits[t]
        usage.append(pb.TenantUsage(
            tenant=ledger.names[t], num_sequences=ledger.num_sequences[t], num_blocks=ledger.num_blocks[t],
            num_sessions=sessions.num_sessions(t), max_blocks=lim.max_blocks or 0,
            max_sequences=lim.max_sequences or 0, max_sessions=lim.max_sessions or 0,
            reserved_blocks=lim.reserved_blocks,
        ))
    return usage


def describe_pool_response(pool: Pool, may_attach: bool = True) -> pb.DescribePoolResponse:
    """The pool's layout; with ``may_attach``, also what maps it (shm name, CUDA IPC handle): mapping the pool
    gives every byte of every tenant's KV (docs/security.md)."""
    layout, info = pool.layout, pool.attach_info()
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
            kv_layout=pb.KvLayout.Value("KV_LAYOUT_" + layout.kv_layout.upper().replace("-", "_")),
        ),
        backend=BACKEND_TO_PB[info.backend],
        pool_bytes=info.pool_bytes,
        cuda_ipc_handle=bytes(info.cuda_ipc_handle or b"") if may_attach else b"",
        cuda_device=info.cuda_device if info.cuda_device is not None else 0,
        shm_name=(info.shm_name or "") if may_attach else "",
        server_pid=os.getpid(),
    )
