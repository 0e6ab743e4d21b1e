"""The host tier with --tensor-parallel (issue 30, item 6): one tier per shard behind one slot-id space. A real
server process offloads evicted blocks and restores them on a prompt's hit with the KV of every head intact,
heads split or replicated, with the write-back thread or offload on eviction, and logs no failure; a tier whose
every copy fails logs a bounded number of lines (rate-limited), however many copies fail."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from kvpool_client import KVPoolClient, PoolStats
from kvpool_server.config import ServerConfig
from kvpool_server.grpc_api.server import build_server
from kvpool_server.log_limits import RateLimitedLog
from kvpool_server.offload import tier_copies, tier_pool

BS = 16
LAYERS, HEAD_DIM = 2, 16
POOL_BLOCKS = 8
TIER_BLOCKS = 64
PROMPT_BLOCKS = 3  # + 5 tokens in a fourth block, never sealed
NUM_PROMPTS = 5  # 15 sealed blocks through an 8-block pool: the oldest are evicted into the tier


def prompt_of(i: int) -> list[int]:
    return [10_000 * (i + 1) + t for t in range(PROMPT_BLOCKS * BS + 5)]


def kv_of(i: int, num_tokens: int, heads: int) -> np.ndarray:
    """Prompt i's KV, a different value in every element (every head of every token)."""
    size = num_tokens * LAYERS * 2 * heads * HEAD_DIM
    return (np.arange(size, dtype=np.float32) + 1e6 * (i + 1)).reshape(num_tokens, LAYERS, 2, heads, HEAD_DIM)


def wait_ready(kv: KVPoolClient) -> PoolStats:
    deadline = time.monotonic() + 30
    while True:
        stats = kv.stats()
        assert stats.host_tier is not None
        if stats.host_tier.num_blocks_ready == stats.host_tier.num_blocks or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def churn(kv: KVPoolClient, heads: int, write_back: bool = False) -> None:
    """Seal and free the prompts in turn; with the write-back thread, each prompt's blocks are let reach the tier
    before the next prompt evicts them (an eviction the write-back did not reach drops the block)."""
    for i in range(NUM_PROMPTS):
        prompt = prompt_of(i)
        seq, cached = kv.register_prompt(prompt)
        assert cached == 0
        kv.append(seq, len(prompt), token_ids=prompt)
        kv.write_kv(seq, 0, kv_of(i, len(prompt), heads))
        kv.append(seq, 1, token_ids=[7])  # seals the full blocks
        kv.free(seq)
        deadline = time.monotonic() + 30
        while write_back and time.monotonic() < deadline:
            tier = kv.stats().host_tier
            if tier is not None and tier.num_blocks_written_back >= PROMPT_BLOCKS * (i + 1):
                break
            time.sleep(0.02)


@pytest.mark.parametrize("heads, tp, writeback", [(4, 2, "0"), (4, 4, "128"), (1, 2, "0")],
                         ids=["split-on-eviction", "split-write-back", "replicated"])
def test_a_tensor_parallel_server_offloads_and_restores_every_heads_kv(server_factory, heads, tp, writeback):
    token_bytes = LAYERS * 2 * heads * HEAD_DIM * 4
    copies = max(1, tp // heads)  # a replicated head is held by tp / heads ranks
    server = server_factory("--num-blocks", str(POOL_BLOCKS), "--tensor-parallel", str(tp),
                            "--num-layers", str(LAYERS), "--num-kv-heads", str(heads), "--head-dim", str(HEAD_DIM),
                            "--block-size", str(BS), "--host-tier-bytes", str(TIER_BLOCKS * BS * token_bytes * copies),
                            "--host-tier-writeback-blocks", writeback)
    with KVPoolClient(server.address, session=False, fast_path=False) as kv:
        wait_ready(kv)
        churn(kv, heads, write_back=writeback != "0")
        deadline = time.monotonic() + 30
        while True:  # the write-back thread copies behind the calls; offload on eviction copies within them
            tier = kv.stats().host_tier
            assert tier is not None
            if tier.num_blocks_cached >= PROMPT_BLOCKS or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        seq, cached = kv.register_prompt(prompt_of(0))  # prompt 0, the oldest: evicted, back from the tier
        assert cached == PROMPT_BLOCKS * BS
        stats = kv.stats()
        got = kv.read_kv(seq, 0, cached)
    assert np.array_equal(np.asarray(got).reshape(cached, LAYERS, 2, heads, HEAD_DIM), kv_of(0, cached, heads))
    tier = stats.host_tier
    assert tier is not None and tier.num_blocks_restored == PROMPT_BLOCKS and stats.prefix_host_hit_tokens == cached
    assert tier.num_offload_failures == 0 and tier.num_blocks_fenced == 0
    assert tier.num_blocks == TIER_BLOCKS  # --host-tier-bytes is the group's, replicated heads counted
    log = server.log()
    assert "failed" not in log and "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("writeback", [0, 128], ids=["on-eviction", "write-back"])
def test_a_tier_whose_every_copy_fails_logs_a_bounded_number_of_lines(caplog, monkeypatch, writeback):
    for module in (tier_copies, tier_pool):  # a fresh 10 s window: an earlier test's failures in this process
        monkeypatch.setattr(module, "failures_log", RateLimitedLog(module.logger))  # must not hold these back
    config = ServerConfig(address="127.0.0.1:0", backend="host", num_blocks=POOL_BLOCKS, tensor_parallel=2,
                          num_layers=LAYERS, num_kv_heads=2, head_dim=HEAD_DIM, host_tier_writeback_blocks=writeback,
                          host_tier_bytes=TIER_BLOCKS * BS * LAYERS * 2 * 2 * HEAD_DIM * 4).validate()
    handle = build_server(config)
    handle.start()
    try:
        tier = handle.service.tier
        assert tier is not None and tier.memory.wait_ready(30)
        tier.memory.fail_every(1)  # every copy, offload or restore, fails from now on
        with caplog.at_level(logging.INFO), KVPoolClient(f"127.0.0.1:{handle.port}", session=False) as kv:
            for _ in range(8):  # offloads on eviction fail within the calls; a write-back thread retries meanwhile
                churn(kv, 2)
            time.sleep(1.0)
            failures = kv.stats().host_tier
        assert failures is not None
        failed = failures.num_offload_failures + failures.num_blocks_torn + failures.num_blocks_fenced
        lines = [r for r in caplog.records if r.name.startswith("kvpool_server")
                 and ("fail" in r.getMessage() or r.exc_info)]
        print(f"{len(lines)} lines for the failures of {failed} blocks (offload failures "
              f"{failures.num_offload_failures}); messages {sorted({r.getMessage()[:60] for r in lines})}")
        assert failed >= (8 * NUM_PROMPTS if not writeback else 1)
        assert 1 <= len(lines) <= 8  # a line per kind of failure per 10 s, not one (and a traceback) per copy
        assert sum(1 for r in lines if r.exc_info) <= 2
    finally:
        handle.stop()
        handle.pool.close()
