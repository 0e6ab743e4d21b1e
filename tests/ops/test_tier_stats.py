"""The host tier's figures in the public API (issue 23): Stats (``host_tier``, the prefix hits by tier), the
Prometheus metrics and ``kvctl stats`` of a server with ``--host-tier-bytes`` on the host backend, after a known
workload that offloads and restores blocks -- the same numbers everywhere, exact where the workload decides them;
restores that fail (fenced) and write-backs overtaken by an eviction (torn) counted; no tier, no tier figures."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from dataclasses import asdict
from typing import Any

import numpy as np
import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvpool_client import KVPoolClient, PoolStats  # noqa: E402
from kvpool_client.kvctl import main as kvctl_main  # noqa: E402
from kvpool_server.config import ServerConfig  # noqa: E402
from kvpool_server.offload import writeback as tier_writeback  # noqa: E402
from kvpool_server.offload.tier_pool import CopyTicket  # noqa: E402
from kvpool_server.grpc_api.server import build_server  # noqa: E402

BS = 16  # tokens a block (the server's default layout)
POOL_BLOCKS = 8
TIER_BLOCKS = 64  # room for every block of the workload: the host LRU drops none
PROMPT_BLOCKS = 3  # full blocks a prompt; its last 5 tokens fill a fourth block, never sealed
NUM_PROMPTS = 5  # 15 distinct sealed blocks through an 8-block pool: the oldest are evicted, then offloaded


def prompt_of(i: int) -> list[int]:
    return [10_000 * (i + 1) + t for t in range(PROMPT_BLOCKS * BS + 5)]


def prefill(kv: KVPoolClient, prompt: list[int]) -> tuple[int, int]:
    """Register, append what was not cached (with its ids) and one decode step (seals the full blocks)."""
    seq, cached = kv.register_prompt(prompt)
    kv.append(seq, len(prompt) - cached, token_ids=prompt[cached:])
    kv.append(seq, 1, token_ids=[7])
    return seq, cached


def churn(kv: KVPoolClient, prompts: range) -> None:
    for i in prompts:
        seq, cached = prefill(kv, prompt_of(i))
        assert cached == 0
        kv.free(seq)


def wait_tier_ready(kv: KVPoolClient) -> PoolStats:
    """The tier is allocated in the background: Stats says when all of it is there."""
    deadline = time.monotonic() + 30
    while True:
        stats = kv.stats()
        assert stats.host_tier is not None and stats.host_tier.num_blocks == TIER_BLOCKS
        if stats.host_tier.num_blocks_ready == TIER_BLOCKS or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def kvctl(capsys: Any, *argv: str) -> str:
    assert kvctl_main(list(argv)) == 0
    return capsys.readouterr().out


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_server_process_reports_its_host_tier_in_stats_metrics_and_kvctl(server_factory, capsys) -> None:
    port = free_port()
    server = server_factory("--num-blocks", str(POOL_BLOCKS), "--host-tier-bytes", str(TIER_BLOCKS * 8192),
                            "--host-tier-writeback-blocks", "0", "--metrics-address", f"127.0.0.1:{port}")
    with KVPoolClient(server.address, session=False) as kv:
        start = wait_tier_ready(kv)
        bb = start.block_bytes
        tier = start.host_tier
        assert tier is not None and bb == 8192
        assert (tier.bytes_total, tier.num_blocks_ready, tier.bytes_ready) == (TIER_BLOCKS * bb, TIER_BLOCKS,
                                                                               TIER_BLOCKS * bb)
        assert tier.num_blocks_used == tier.num_blocks_offloaded == tier.bytes_offloaded == 0
        churn(kv, range(NUM_PROMPTS))
        before = kv.stats()
        tier = before.host_tier
        assert tier is not None
        # every sealed block is in exactly one place: still cached in the pool, or evicted and offloaded
        evicted = NUM_PROMPTS * PROMPT_BLOCKS - before.num_blocks_evictable
        assert evicted >= PROMPT_BLOCKS  # prompt 0, the oldest, at least
        assert tier.num_blocks_offloaded == tier.num_blocks_cached == tier.num_blocks_used == evicted
        assert tier.bytes_offloaded == evicted * bb and tier.offload_seconds > 0
        assert tier.num_blocks_restored == tier.bytes_restored == 0 and tier.restore_seconds == 0
        assert tier.num_blocks_written_back == 0  # no write-back thread: offloads on eviction
        assert before.prefix_query_tokens == NUM_PROMPTS * len(prompt_of(0)) and before.prefix_hit_tokens == 0

        seq, cached = prefill(kv, prompt_of(0))  # prompt 0 comes back from the host tier
        assert cached == PROMPT_BLOCKS * BS
        after = kv.stats()
    tier = after.host_tier
    assert tier is not None
    assert (tier.num_blocks_restored, tier.bytes_restored) == (PROMPT_BLOCKS, PROMPT_BLOCKS * bb)
    assert tier.restore_seconds > 0 and tier.restore_bytes_per_s > 0 and tier.offload_bytes_per_s > 0
    assert after.prefix_host_hit_tokens == after.prefix_hit_tokens == PROMPT_BLOCKS * BS
    assert after.prefix_query_tokens == (NUM_PROMPTS + 1) * len(prompt_of(0))
    evicted = NUM_PROMPTS * PROMPT_BLOCKS - after.num_blocks_evictable  # prompt 0's blocks are held, not evictable
    assert tier.num_blocks_offloaded == tier.num_blocks_cached == tier.num_blocks_used == evicted
    assert tier.bytes_offloaded == evicted * bb
    assert (tier.num_offload_failures, tier.num_blocks_fenced, tier.num_blocks_torn, tier.num_blocks_dropped,
            tier.num_evictions_unkept) == (0, 0, 0, 0, 0)

    got = scrape(f"http://127.0.0.1:{port}/metrics")
    assert got["kvpool_host_tier_blocks"] == TIER_BLOCKS and got["kvpool_host_tier_blocks_ready"] == TIER_BLOCKS
    assert got["kvpool_host_tier_size_bytes"] == got["kvpool_host_tier_ready_bytes"] == TIER_BLOCKS * bb
    assert got["kvpool_host_tier_blocks_used"] == got["kvpool_host_tier_blocks_cached"] == evicted
    assert got["kvpool_host_tier_offloaded_blocks_total"] == evicted
    assert got["kvpool_host_tier_offloaded_bytes_total"] == evicted * bb
    assert got["kvpool_host_tier_offload_seconds_total"] == pytest.approx(tier.offload_seconds)
    assert got["kvpool_host_tier_restored_blocks_total"] == PROMPT_BLOCKS
    assert got["kvpool_host_tier_restored_bytes_total"] == PROMPT_BLOCKS * bb
    assert got["kvpool_host_tier_restore_seconds_total"] == pytest.approx(tier.restore_seconds)
    assert got["kvpool_prefix_cache_host_hits_total"] == got["kvpool_prefix_cache_hits_total"] == PROMPT_BLOCKS * BS
    for name in ("written_back_blocks", "offload_failures", "fenced_blocks", "torn_blocks", "dropped_blocks",
                 "unkept_evictions"):
        assert got[f"kvpool_host_tier_{name}_total"] == 0, name

    data = json.loads(kvctl(capsys, "--target", server.address, "stats", "--json"))
    assert data["host_tier"] == asdict(tier)  # no copy since: the same figures, seconds included
    assert (data["prefix_hit_tokens"], data["prefix_host_hit_tokens"]) == (PROMPT_BLOCKS * BS, PROMPT_BLOCKS * BS)
    text = kvctl(capsys, "--target", server.address, "stats")
    assert f"{evicted} used ({evicted} cached) of {TIER_BLOCKS} blocks, 0.50 MiB; all ready" in text
    assert f"{evicted} blocks offloaded (0 written back ahead), {PROMPT_BLOCKS} restored" in text
    assert f": 0 from the pool, {PROMPT_BLOCKS * BS} from the host tier" in text
    assert "0 fenced restores, 0 torn write-backs" in text and ("MiB/s" in text or "GiB/s" in text)


def test_without_a_host_tier_there_are_no_tier_figures(server, capsys) -> None:
    with KVPoolClient(server.address, session=False) as kv:
        churn(kv, range(2))
        stats = kv.stats()
    assert stats.host_tier is None and stats.prefix_host_hit_tokens == 0
    assert stats.prefix_query_tokens == 2 * len(prompt_of(0))
    data = json.loads(kvctl(capsys, "--target", server.address, "stats", "--json"))
    assert data["host_tier"] is None
    text = kvctl(capsys, "--target", server.address, "stats")
    assert "host tier" not in text and f"0 of {2 * len(prompt_of(0))} prompt tokens" in text


@pytest.fixture
def in_process():  # type: ignore[no-untyped-def]
    """A server as build_server wires it, in this process: the tests reach its tier (failure hook, write-backs)."""
    config = ServerConfig(address="127.0.0.1:0", backend="host", num_blocks=POOL_BLOCKS,
                          host_tier_bytes=TIER_BLOCKS * 8192, host_tier_writeback_blocks=0).validate()
    handle = build_server(config)
    handle.start()
    assert handle.service.tier is not None and handle.service.tier.memory.wait_ready(30)
    try:
        with KVPoolClient(f"127.0.0.1:{handle.port}", session=False) as kv:
            yield handle, kv
    finally:
        handle.stop()
        handle.pool.close()


def test_a_failed_restore_counts_its_fenced_blocks(in_process, capsys) -> None:
    handle, kv = in_process
    churn(kv, range(NUM_PROMPTS))
    before = kv.stats().host_tier
    assert before is not None
    handle.service.tier.memory.inject_failures(1, offloads=False)  # the next restore: half copied, then it raises
    seq, cached = prefill(kv, prompt_of(0))
    assert cached == 0  # a miss
    tier = kv.stats().host_tier
    assert tier is not None
    assert (tier.num_blocks_fenced, tier.num_blocks_restored, tier.bytes_restored) == (PROMPT_BLOCKS, 0, 0)
    assert tier.num_offload_failures == 0
    text = kvctl(capsys, "--target", f"127.0.0.1:{handle.port}", "stats")
    assert f"0 failed offloads, {PROMPT_BLOCKS} fenced restores" in text


class Unfinished(CopyTicket):
    """A write-back whose copy has not completed yet (the copy engine is behind): ``settle`` leaves it in flight."""

    def done(self) -> bool:
        return False


def test_write_backs_overtaken_by_an_eviction_count_as_torn(in_process) -> None:
    handle, kv = in_process
    svc = handle.service
    churn(kv, range(2))  # 6 sealed blocks, all still cached (8-block pool)
    with svc.guard.lock:  # as the write-back thread would: plan a batch, its copy in flight
        tier, cache = svc.tier.tier, svc.guard.manager.allocator.cache
        tier.offload_on_evict = False  # what start_writeback does
        pairs = tier_writeback.plan(tier, cache.evictable, cache.entries, 64)
        svc.tier.writebacks.append((Unfinished(), pairs))
    in_flight = len(pairs)
    assert in_flight == 2 * PROMPT_BLOCKS
    churn(kv, range(2, 2 + NUM_PROMPTS))  # 15 new blocks through the pool: every block in flight is evicted
    stats = kv.stats()
    assert stats.host_tier is not None and stats.host_tier.num_blocks_used == in_flight  # pending, not committed
    with svc.guard.lock:
        svc.tier.finish_writebacks(wait=True)
    tier_stats = kv.stats().host_tier
    assert tier_stats is not None
    assert tier_stats.num_blocks_torn == in_flight
    assert tier_stats.num_blocks_offloaded == tier_stats.num_blocks_cached == tier_stats.num_blocks_used == 0
    # the new prompts' evicted blocks: no write-back had copied them, so the tier did not keep them
    assert tier_stats.num_evictions_unkept == NUM_PROMPTS * PROMPT_BLOCKS - stats.num_blocks_evictable
    assert np.isclose(tier_stats.offload_seconds, 0.0)


def test_the_write_back_threads_copies_are_counted(server_factory) -> None:
    """With the write-back on (the default), every offload is a write-back, counted when its batch settles."""
    server = server_factory("--num-blocks", str(POOL_BLOCKS), "--host-tier-bytes", str(TIER_BLOCKS * 8192))
    with KVPoolClient(server.address, session=False) as kv:
        wait_tier_ready(kv)
        churn(kv, range(NUM_PROMPTS))
        deadline, previous = time.monotonic() + 30, None
        while time.monotonic() < deadline:  # until the write-back has copied every cached block and rests
            stats = kv.stats()
            tier = stats.host_tier
            assert tier is not None
            if stats == previous and tier.num_blocks_cached >= stats.num_blocks_evictable:
                break
            previous = stats
            time.sleep(0.1)
    assert tier.num_blocks_written_back == tier.num_blocks_offloaded > 0
    assert tier.bytes_offloaded == (tier.num_blocks_offloaded + tier.num_blocks_torn) * stats.block_bytes
    assert tier.offload_seconds > 0 and tier.num_offload_failures == 0
