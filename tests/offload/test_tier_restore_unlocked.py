"""A host-tier restore copies with the guard's lock released (docs/prefix-caching.md, "The host tier"): a decode
step appends while a register's restore is mid-copy; nobody sees the restored blocks half-done (not matchable, a
concurrent register of the same prompt misses); the register then hits and reads back the same KV. Structure, not
timing: the instrumented restore blocks on an Event until the test has made its concurrent calls."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from kvpool_server.core import prefix_reuse
from kvpool_server.offload import writeback as tier_writeback
from kvpool_server.core.errors import InvalidArgumentError
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.scope import CallScope
from tests.service.service_helpers import BLOCK_SIZE
from tests.offload.test_service_host_tier import (
    InFlight,
    PROMPT_BLOCKS,
    check,
    evict_everything,
    free,
    prefill,
    prompt_of,
    read,
)

FULL = PROMPT_BLOCKS * BLOCK_SIZE
WAIT_S = 30  # only so that a broken build fails instead of hanging: nothing here depends on how long a step takes


class HeldRestores:
    """The tier's ``restore_blocks``, instrumented: each call says it ``entered``, then copies only once ``release``
    is set."""

    def __init__(self, svc: KVPoolService) -> None:
        assert svc.tier is not None
        memory = svc.tier.memory
        self.entered, self.release = threading.Event(), threading.Event()
        copy = memory.restore_blocks

        def held(pairs: Any) -> int:
            self.entered.set()
            assert self.release.wait(WAIT_S)
            return copy(pairs)

        memory.restore_blocks = held  # type: ignore[method-assign]


def in_thread(fn: Any) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def evicted_prompt(svc: KVPoolService, scope: CallScope) -> bytes:
    """Prompt 0 prefilled (tag 0), freed and evicted into the tier; returns its KV."""
    seq, _ = prefill(svc, scope, prompt_of(0), tag=0)
    kv = read(svc, scope, seq, FULL)
    free(svc, scope, seq)
    evict_everything(svc, scope)
    tier = svc.tier.tier if svc.tier is not None else None
    assert tier is not None and not svc.guard.manager.allocator.cache.match(hashes_of(svc, 0))
    assert all(h in tier.slot_of_hash for h in hashes_of(svc, 0))  # in the tier, committed
    return kv


def hashes_of(svc: KVPoolService, i: int) -> list[bytes]:
    manager = svc.guard.manager
    return prefix_reuse.reusable_hashes(np.array(prompt_of(i)), manager.block_size, manager.tenants.names[0].encode(),
                                        0, b"")


def test_an_append_runs_while_a_restore_copies_and_nobody_sees_it_half_done(tiered) -> None:
    svc, scope = tiered
    first_kv = evicted_prompt(svc, scope)
    with scope.call("RegisterSequence") as call:
        decoding = svc.register(call).seq_id
    held = HeldRestores(svc)

    def register_prompt() -> tuple[int, int]:
        with scope.call("RegisterSequence") as call:
            return svc.register(call, prompt_token_ids=prompt_of(0))

    restorer, registered = in_thread(register_prompt)
    assert held.entered.wait(WAIT_S)  # the restore is mid-copy: staged, its bytes not there yet

    def decode_step() -> int:
        with scope.call("AppendToken") as call:
            return svc.append(call, [decoding], [1]).num_new_tokens

    stepper, stepped = in_thread(decode_step)
    stepper.join(WAIT_S)
    assert stepped == [1]  # the append completed while the restore still waits: the lock is not held by the copy
    assert restorer.is_alive() and not registered
    manager = svc.guard.manager
    with svc.guard.lock:
        assert not manager.allocator.cache.match(hashes_of(svc, 0))  # the restored blocks are not matchable yet
        assert svc.tier is not None and len(svc.tier.tier.restoring) == 1
        manager.check_invariants()  # the restore's references are accounted for mid-copy
        svc.tier.tier.check_invariants()
    held.entered.clear()
    with scope.call("RegisterSequence") as call:  # the same prompt meanwhile: its blocks are pinned, a miss
        other, other_cached, _ = svc.register(call, prompt_token_ids=prompt_of(0))
    assert other_cached == 0 and not held.entered.is_set()
    free(svc, scope, other)

    held.release.set()
    restorer.join(WAIT_S)
    seq, cached, _ = registered[0]
    assert cached == FULL
    assert read(svc, scope, seq, FULL) == first_kv
    assert svc.tier is not None and not svc.tier.tier.restoring and not svc.tier.tier.pinned
    check(svc)


def test_a_register_refused_after_its_restore_still_settles_it(tiered) -> None:
    svc, scope = tiered
    first_kv = evicted_prompt(svc, scope)
    with scope.call("RegisterSequence") as call:
        svc.register(call, request_id=7, prompt_token_ids=prompt_of(1))
    with scope.call("RegisterSequence") as call, pytest.raises(InvalidArgumentError):
        svc.register(call, request_id=7, prompt_token_ids=prompt_of(0))  # the id reused: refused before apply
    manager = svc.guard.manager
    assert svc.tier is not None and not svc.tier.tier.restoring and not svc.tier.tier.pinned
    check(svc)
    assert len(manager.allocator.cache.match(hashes_of(svc, 0))) == PROMPT_BLOCKS  # restored, settled: cached
    seq, cached = prefill(svc, scope, prompt_of(0), tag=99)
    assert cached == FULL and read(svc, scope, seq, FULL) == first_kv


def test_with_the_write_back_on_an_eviction_never_waits_and_never_copies_under_the_lock(tiered) -> None:
    """An eviction the write-back did not reach drops the block (a miss later); one of a block whose write-back is
    in flight does not wait for it: that slot is torn, aborted when the write-back settles, never matchable."""
    svc, scope = tiered
    assert svc.tier is not None
    tier = svc.tier.tier
    tier.offload_on_evict = False  # what start_writeback sets (the thread itself is not started: the test drives it)
    seq, _ = prefill(svc, scope, prompt_of(0), tag=0)
    free(svc, scope, seq)
    seq, _ = prefill(svc, scope, prompt_of(1), tag=1)
    free(svc, scope, seq)
    with svc.guard.lock:  # prompt 0's and 1's blocks: a write-back queued, its copy not run yet
        cache = svc.guard.manager.allocator.cache
        pairs = tier_writeback.plan(tier, cache.evictable, cache.entries, PROMPT_BLOCKS)
        assert len(pairs) == PROMPT_BLOCKS
        svc.tier.writebacks.append((InFlight(svc.tier.memory, pairs), pairs))
    copies = []
    offload = svc.tier.memory.offload_blocks
    svc.tier.memory.offload_blocks = lambda p: copies.append(p) or offload(p)  # type: ignore[method-assign]
    evict_everything(svc, scope, first=2)  # evicts prompts 0 and 1 (and more): no copy, no wait
    assert not copies and tier.torn == set(pairs[:, 1].tolist())
    check(svc)  # between calls: the torn slots are pending, their blocks gone from the pool
    with svc.guard.lock:
        svc.tier.finish_writebacks(wait=True)  # the write-back settles: its copy (of overwritten blocks) is dropped
    assert not tier.torn and tier.num_offloaded == 0 and tier.num_offload_failed == 0
    for i in (0, 1):
        seq, cached = prefill(svc, scope, prompt_of(i), tag=99)
        assert cached == 0  # a miss: neither the evicted blocks nor the torn copies are ever served
        free(svc, scope, seq)
    check(svc)


def test_a_write_back_that_completed_is_settled_before_a_call_evicts_its_blocks(tiered) -> None:
    """A call that evicts a write-back's blocks first commits the write-backs whose copy completed (``TierCopies.store_plan``,
    ``settle``): its blocks are kept (not torn) and come back with their KV."""
    svc, scope = tiered
    assert svc.tier is not None
    tier, full = svc.tier.tier, PROMPT_BLOCKS * BLOCK_SIZE
    tier.offload_on_evict = False
    seq, _ = prefill(svc, scope, prompt_of(0), tag=0)
    first_kv = read(svc, scope, seq, full)
    free(svc, scope, seq)
    with svc.guard.lock:  # a write-back whose copy completed, not settled yet (its thread has not re-taken the lock)
        cache = svc.guard.manager.allocator.cache
        pairs = tier_writeback.plan(tier, cache.evictable, cache.entries, PROMPT_BLOCKS)
        ticket = svc.tier.memory.start_offload(pairs)
        assert ticket.wait()  # the copy completed (what the write-back thread waits for, outside the lock)
        svc.tier.writebacks.append((ticket, pairs))
    # the call that evicts them settles first (``store_plan``); a restore's staging settles too
    evict_everything(svc, scope)
    assert tier.num_torn == 0 and tier.num_written_back == PROMPT_BLOCKS
    seq, cached = prefill(svc, scope, prompt_of(0), tag=99)
    assert cached == full and read(svc, scope, seq, full) == first_kv
    check(svc)
