"""The KV-head split of a tensor-parallel group: which heads rank ``r`` of ``N`` holds, and its shard's layout.

One server, one allocator, one block-id space; N pools, one a rank, each holding every block for its heads only::

    full layout  [num_blocks, L, 2, block_size, H,     D]      the wire format of WriteKV / ReadKV
    rank r       [num_blocks, L, 2, block_size, H / N, D]      heads [r * H / N, (r + 1) * H / N)

When N exceeds H (vLLM's rule for GQA models on a large TP group) each rank holds ONE head, replicated: rank ``r``
holds head ``r * H // N``, so N / H ranks hold each head. Both cases are one formula -- rank ``r`` holds
``max(1, H // N)`` heads from ``r * H // N`` -- valid when ``H % N == 0`` or ``N % H == 0`` (else ValueError).

Shared by the server (which makes the shards) and the client (which maps one rank's shard and splits or joins a
whole token's heads); imports nothing but the layout.
"""

from __future__ import annotations

import dataclasses

from kvpool.layout import KVLayout

MAX_TENSOR_PARALLEL = 64


def check_split(num_kv_heads: int, tensor_parallel: int) -> None:
    """Raise ValueError unless ``num_kv_heads`` heads split evenly over ``tensor_parallel`` ranks (or each rank
    holds one replicated head)."""
    if not 1 <= tensor_parallel <= MAX_TENSOR_PARALLEL:
        raise ValueError(f"tensor_parallel must be in [1, {MAX_TENSOR_PARALLEL}], got {tensor_parallel}")
    if num_kv_heads % tensor_parallel and tensor_parallel % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads do not split over {tensor_parallel} ranks: one must divide the "
                         "other (heads / ranks each, or one head a rank, replicated)")


def heads_per_rank(num_kv_heads: int, tensor_parallel: int) -> int:
    check_split(num_kv_heads, tensor_parallel)
    return max(1, num_kv_heads // tensor_parallel)


def rank_heads(num_kv_heads: int, tensor_parallel: int, rank: int) -> range:
    """The heads of the full layout that ``rank`` holds."""
    count = heads_per_rank(num_kv_heads, tensor_parallel)
    if not 0 <= rank < tensor_parallel:
        raise ValueError(f"rank must be in [0, {tensor_parallel}), got {rank}")
    first = rank * num_kv_heads // tensor_parallel
    return range(first, first + count)


def shard_layout(layout: KVLayout, tensor_parallel: int) -> KVLayout:
    """The layout of every rank's pool: ``layout`` with ``heads_per_rank`` heads."""
    return dataclasses.replace(layout, num_kv_heads=heads_per_rank(layout.num_kv_heads, tensor_parallel))


def group_block_bytes(layout: KVLayout, tensor_parallel: int) -> int:
    """Bytes one block takes over all ranks: ``layout.block_bytes``, more when heads are replicated."""
    return tensor_parallel * shard_layout(layout, tensor_parallel).block_bytes
