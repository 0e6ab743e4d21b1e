"""The pool's figures (beside the host tier's: offload/tier_stats.py), each declared once: its name -- the ``PoolStats``
field or property, the proto's ``StatsResponse`` field and the client's ``PoolStats`` field, all one name -- and
its Prometheus family. The proto mapping (grpc_api/messages.stats_response) and the metrics (service/metrics.py)
are made from this table; PoolStats, the proto and the client's type are checked against it
(tests/proto/test_stats_figures.py: a figure one of them misses, or one only it has, fails).
"""

from __future__ import annotations

from typing import NamedTuple


class PoolFigure(NamedTuple):
    name: str  # PoolStats's field (or property), StatsResponse's field, the client's PoolStats field
    metric: str
    kind: str  # "counter" or "gauge"
    help: str


POOL_FIGURES: tuple[PoolFigure, ...] = (
    PoolFigure("num_blocks_total", "kvpool_blocks", "gauge", "Blocks in the pool (its capacity)"),
    PoolFigure("num_blocks_free", "kvpool_blocks_free", "gauge", "Blocks on the free list"),
    PoolFigure("num_blocks_used", "kvpool_blocks_used", "gauge", "Blocks referenced by at least one sequence"),
    PoolFigure("num_blocks_evictable", "kvpool_blocks_evictable", "gauge", "Cached blocks no sequence holds (prefix "
               "cache; allocatable, LRU first)"),
    PoolFigure("num_blocks_shared", "kvpool_blocks_shared", "gauge", "Blocks referenced by more than one sequence "
               "(fork sharing)"),
    PoolFigure("utilization", "kvpool_usage_ratio", "gauge", "Used blocks / all blocks"),
    PoolFigure("num_sequences", "kvpool_sequences", "gauge", "Live sequences"),
    PoolFigure("num_tokens", "kvpool_tokens", "gauge", "Tokens over all live sequences (a shared token counts once "
               "per sequence)"),
    PoolFigure("num_slots_unused", "kvpool_slots_unused", "gauge", "Token slots inside used blocks that hold no "
               "token (counted once a block)"),
    PoolFigure("internal_fragmentation", "kvpool_internal_fragmentation_ratio", "gauge", "Unused slots / slots of "
               "used blocks"),
    PoolFigure("block_size", "kvpool_block_size_tokens", "gauge", "Tokens a block holds"),
    PoolFigure("num_copies", "kvpool_cow_copies", "counter", "Copy-on-write block copies since start"),
    PoolFigure("prefix_query_tokens", "kvpool_prefix_cache_queries", "counter", "Prompt tokens looked up in the "
               "prefix cache (RegisterSequence with prompt_token_ids; vLLM's prefix_cache_queries)"),
    PoolFigure("prefix_hit_tokens", "kvpool_prefix_cache_hits", "counter", "Of those, tokens found cached (hit rate: "
               "the ratio of the two counters' rates)"),
    PoolFigure("prefix_host_hit_tokens", "kvpool_prefix_cache_host_hits", "counter", "Of the prefix cache hits, "
               "tokens restored from the host tier"),
    PoolFigure("num_tokens_appended", "kvpool_appended_tokens", "counter", "Tokens appended (slots handed out)"),
    PoolFigure("num_blocks_evicted", "kvpool_prefix_cache_evicted_blocks", "counter", "Cached blocks evicted from "
               "the prefix cache to make room"),
)
