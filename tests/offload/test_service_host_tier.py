"""The host tier through the service, on the host backend (docs/prefix-caching.md, "The host tier"): a prompt evicted
from the pool hits in the tier and reads back the same KV after the restore; injected copy failures (offload or
restore, cut short halfway) fall back to a miss and never serve wrong KV; the hit rate is higher with the tier."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from kvpool_server.config import ServerConfig
from kvpool_server.offload import writeback as tier_writeback
from kvpool_server.offload.tier_pool import CopyTicket, TierPool
from kvpool_server.service.build import build_service
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.scope import CallScope
from tests.service.service_helpers import BLOCK_SIZE, TOKEN_BYTES, token_kv

NUM_BLOCKS = 16
PROMPT_BLOCKS = 3
# KVPOOL_TEST_BACKEND=gpu (scripts/gpu_check.sh tier): the same tests over a GPU pool and its pinned tier
BACKEND = "gpu" if os.environ.get("KVPOOL_TEST_BACKEND") == "gpu" else "host"


def prompt_of(i: int) -> list[int]:
    return [(1000 * i + t) % 50_000 for t in range(PROMPT_BLOCKS * BLOCK_SIZE + 5)]


def make(tier_blocks: int, wait: bool = True) -> tuple[KVPoolService, CallScope]:
    """A service whose tier offloads on eviction only (no write-back thread: the tests drive write-backs)."""
    config = ServerConfig(backend=BACKEND, num_blocks=NUM_BLOCKS, host_tier_bytes=tier_blocks * BLOCK_SIZE * TOKEN_BYTES,
                          host_tier_writeback_blocks=0)
    svc, admission = build_service(config)
    if svc.tier is not None and wait:
        assert svc.tier.memory.wait_ready(30)
    return svc, CallScope(admission, None, None)


def prefill(svc: KVPoolService, scope: CallScope, prompt: list[int], tag: int) -> tuple[int, int]:
    """Register, append what was not cached (with ids), write its KV (tagged ``tag``), seal with one decode step.
    Returns (seq_id, num_cached_tokens)."""
    with scope.call("RegisterSequence") as call:
        seq, cached, _ = svc.register(call, prompt_token_ids=prompt)
    with scope.call("AppendToken") as call:
        svc.append(call, [seq], [len(prompt) - cached], prompt[cached:])
    with scope.call("WriteKV") as call:
        svc.write_kv(call, seq, cached, token_kv(tag, range(cached, len(prompt))).tobytes())
    with scope.call("AppendToken") as call:
        svc.append(call, [seq], [1], [1])
    return seq, cached


def read(svc: KVPoolService, scope: CallScope, seq: int, num_tokens: int) -> bytes:
    with scope.call("ReadKV") as call:
        data = svc.read_kv(call, seq, 0, num_tokens)
    assert isinstance(data, bytes)
    return data


def free(svc: KVPoolService, scope: CallScope, seq: int) -> None:
    with scope.call("Free") as call:
        svc.free(call, [seq])


def evict_everything(svc: KVPoolService, scope: CallScope, first: int = 1) -> None:
    """Prefill and free other prompts until the pool has been turned over (the earlier prompts are evicted)."""
    for i in range(first, first + NUM_BLOCKS // PROMPT_BLOCKS + 2):
        seq, _ = prefill(svc, scope, prompt_of(i), tag=i)
        free(svc, scope, seq)


def check(svc: KVPoolService) -> None:
    with svc.guard.lock:
        svc.guard.manager.check_invariants()
        if svc.tier is not None:
            svc.tier.tier.check_invariants()


def test_an_evicted_prompt_hits_in_the_tier_and_reads_back_the_same_kv(tiered) -> None:
    svc, scope = tiered
    full = PROMPT_BLOCKS * BLOCK_SIZE
    seq, _ = prefill(svc, scope, prompt_of(0), tag=0)
    first_kv = read(svc, scope, seq, full)
    free(svc, scope, seq)
    evict_everything(svc, scope)
    tier = svc.tier.tier if svc.tier is not None else None
    assert tier is not None and tier.num_offloaded >= PROMPT_BLOCKS
    seq, cached = prefill(svc, scope, prompt_of(0), tag=99)  # tag 99: a recompute would write other bytes
    assert cached == full
    assert read(svc, scope, seq, full) == first_kv
    assert tier.num_restored * BLOCK_SIZE == full  # the host hit tokens (Stats.prefix_host_hit_tokens)
    check(svc)


@pytest.mark.parametrize("where", ["restore", "offload"])
def test_a_failed_copy_is_a_miss_never_wrong_kv(tiered, where: str) -> None:
    svc, scope = tiered
    full = PROMPT_BLOCKS * BLOCK_SIZE
    seq, _ = prefill(svc, scope, prompt_of(0), tag=0)
    free(svc, scope, seq)
    assert svc.tier is not None
    if where == "offload":
        svc.tier.memory.inject_failures(1, restores=False)  # the first offload (the first prompt's blocks): half copied, then raises
    evict_everything(svc, scope)
    if where == "restore":
        svc.tier.memory.inject_failures(1, offloads=False)  # the restore: half its blocks copied, then it raises
    seq, cached = prefill(svc, scope, prompt_of(0), tag=99)
    assert cached < full  # a miss where the copy failed
    expected = token_kv(99, range(cached, len(prompt_of(0)))).tobytes()
    assert read(svc, scope, seq, len(prompt_of(0)))[cached * TOKEN_BYTES:] == expected  # what this writer wrote
    check(svc)
    if where == "restore":  # the fenced slots are gone: the next register is a plain miss, with no failure
        seq2, cached2 = prefill(svc, scope, prompt_of(0), tag=7)
        assert cached2 == full  # the recomputed blocks (tag 99) were sealed and are cached in the pool now
        assert read(svc, scope, seq2, full) == read(svc, scope, seq, full)


def test_the_hit_rate_is_higher_with_the_tier() -> None:
    rates = []
    for tier_blocks in (0, 64):
        svc, scope = make(tier_blocks)
        try:
            rng = np.random.default_rng(0)
            for i in rng.integers(0, 10, size=60).tolist():  # 10 prompts of 4 blocks: 2.5x the pool
                seq, _ = prefill(svc, scope, prompt_of(i), tag=i)
                free(svc, scope, seq)
            check(svc)
            stats, _ = svc.stats(scope_call(scope))
            rates.append(stats.prefix_hit_tokens / stats.prefix_query_tokens)
        finally:
            svc.guard.pool.close()
    print(f"token hit rate without the tier {rates[0]:.2f}, with it {rates[1]:.2f}")
    assert rates[1] > rates[0]


def scope_call(scope: CallScope):  # type: ignore[no-untyped-def]
    with scope.call("Stats") as call:
        return call


class InFlight(CopyTicket):
    """A write-back still in flight: its copy happens only when it is waited for (as a copy engine that has not
    read the block yet), so a block written before the wait would be copied with the wrong bytes."""

    def __init__(self, memory: TierPool, pairs: np.ndarray) -> None:
        super().__init__()
        self.memory, self.pairs, self.ran = memory, pairs, False

    def done(self) -> bool:
        return self.ran

    def wait(self) -> bool:
        if not self.ran:
            self.memory.offload_blocks(self.pairs)
            self.ran = True
        return True


def test_a_write_back_makes_eviction_free_and_an_eviction_waits_for_one_in_flight(tiered) -> None:
    svc, scope = tiered
    assert svc.tier is not None
    tier, full = svc.tier.tier, PROMPT_BLOCKS * BLOCK_SIZE
    seq, _ = prefill(svc, scope, prompt_of(0), tag=0)
    first_kv = read(svc, scope, seq, full)
    free(svc, scope, seq)
    assert svc.tier.writeback_once(svc.guard.lock, 64) == PROMPT_BLOCKS  # written back ahead, still in the pool
    assert tier.num_written_back == PROMPT_BLOCKS and svc.guard.manager.allocator.cache.num_evictable == PROMPT_BLOCKS
    seq, _ = prefill(svc, scope, prompt_of(1), tag=1)
    free(svc, scope, seq)
    with svc.guard.lock:  # prompt 1's blocks: a write-back queued but not copied yet
        cache = svc.guard.manager.allocator.cache
        pairs = tier_writeback.plan(tier, cache.evictable, cache.entries, 64)
        assert len(pairs) == PROMPT_BLOCKS
        svc.tier.writebacks.append((InFlight(svc.tier.memory, pairs), pairs))
    offloads_before = tier.num_offloaded
    evict_everything(svc, scope, first=2)  # evicts prompts 0 and 1: no copy for 0, a wait for 1's write-back
    with svc.guard.lock:
        svc.tier.finish_writebacks(wait=True)  # what the write-back thread does next (nothing left, if it waited)
    assert tier.num_offloaded > offloads_before
    for i, tag in ((0, 0), (1, 1)):
        seq, cached = prefill(svc, scope, prompt_of(i), tag=99)
        assert cached == full
        expected = first_kv if i == 0 else token_kv(tag, range(full)).tobytes()
        assert read(svc, scope, seq, full) == expected
        free(svc, scope, seq)
    check(svc)


@pytest.mark.parametrize(("changes", "message"), [
    ({"host_tier_bytes": 100}, "--host-tier-bytes 100 is less than one block (8192 bytes)"),
    ({"host_tier_bytes": -1}, "--host-tier-bytes must be >= 0"),
    ({"host_tier_writeback_blocks": -1}, "--host-tier-writeback-blocks must be >= 0"),
])
def test_the_tier_settings_are_checked(changes: dict, message: str) -> None:
    from kvpool_server.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        ServerConfig(**changes).validate()


def test_stats_say_how_much_of_the_tier_is_ready(tiered) -> None:
    svc, scope = tiered
    stats, _ = svc.stats(scope_call(scope))
    assert stats.host_tier_blocks_total == stats.host_tier_blocks_ready == 64 and stats.host_tier_blocks_cached == 0


def test_the_wire_carries_the_tiers_medium() -> None:
    """A GPU pool's events say "GPU"; the host tier's say "CPU" (on the host backend both are "CPU")."""
    from array import array

    from kvpool_server.core.kv_event_types import BlockRemoved, BlockStored
    from kvpool_server.core.kv_events import EventBatch
    from kvpool_server.grpc_api.messages import batch_message

    events = (BlockStored((b"h" * 32,), None, array("I", [1] * 16), 16), BlockStored((b"c" * 32,), None,
              array("I", [2] * 16), 16, b"", medium="CPU"), BlockRemoved((b"h" * 32,)), BlockRemoved((b"c" * 32,), "CPU"))
    message = batch_message(EventBatch(1, 1, events), 0, medium="GPU")
    assert [e.block_stored.medium or e.block_removed.medium for e in message.events] == ["GPU", "CPU", "GPU", "CPU"]


def test_the_pool_serves_while_the_tier_is_being_allocated(monkeypatch) -> None:
    """The tier's memory comes chunk by chunk from a background thread: calls are served before any of it is
    there (evictions then simply forget), and the slots join as their chunk arrives."""
    import threading

    from kvpool_server.offload.tier_pool import HostTierPool

    backend_class: type[TierPool] = HostTierPool
    if BACKEND == "gpu":
        from kvpool_server.offload.gpu_tier_pool import GpuTierPool

        backend_class = GpuTierPool
    gate = threading.Event()
    allocate = backend_class._allocate_chunk

    def slow_chunk(self: TierPool, nbytes: int) -> np.ndarray:
        assert gate.wait(30)
        return allocate(self, nbytes)

    monkeypatch.setattr(backend_class, "_allocate_chunk", slow_chunk)
    svc, scope = make(64, wait=False)  # the gate is shut: no chunk yet
    try:
        assert svc.tier is not None and svc.tier.memory.ready_slots == 0
        evict_everything(svc, scope, first=0)  # served, evicting, with no slot ready
        stats, _ = svc.stats(scope_call(scope))
        assert stats.host_tier_blocks_ready == 0 and stats.host_tier_blocks_cached == 0
        check(svc)
        gate.set()
        assert svc.tier.memory.wait_ready(30)
        evict_everything(svc, scope, first=10)
        stats, _ = svc.stats(scope_call(scope))
        assert stats.host_tier_blocks_ready == 64 and stats.host_tier_blocks_cached > 0
        check(svc)
    finally:
        gate.set()
        svc.guard.pool.close()
