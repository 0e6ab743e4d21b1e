"""The model-based test of test_stateful.py with a host tier (docs/prefix-caching.md, "The host tier"): evicted
cached blocks, named in the appends' plans, are offloaded into a small tier (so its own LRU drops blocks too), prompts are restored from it before
``register``, blocks are written back ahead (their copy running later, or when an eviction waits for it), and
copies fail on demand (an offload aborted, a restore cut short halfway and fenced). The service may turn offload
on eviction off (its write-back thread: an eviction drops the block, or tears an in-flight write-back's slot), and
a restore's copy runs with the lock released: between its staging and its finish, write-backs run, a second
staging of the same prompt takes nothing, and the invariants hold (the staging's references counted). Every step
still checks that each sequence reads back exactly its own tokens, the invariants (the tier's included), and that an
event consumer's index equals what the two tiers hold."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from kvpool_server.core import KVCacheManager
from kvpool_server.core.block_hash import NONE_HASH
from kvpool_server.core.kv_events import KVEventLog
from kvpool_server.offload import restore, writeback
from kvpool_server.offload.host_tier import HostTier, StorePlan
from tests.core.conftest import tag_memory
from tests.core.event_consumer import EventConsumer, cache_index
from tests.core.test_stateful import BLOCK_SIZE, MAX_SEQ_LEN, NUM_BLOCKS, ManagerMachine

TIER_SLOTS = 3  # smaller than a prompt: the tier's own LRU drops blocks too


class TieredMachine(ManagerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, max_seq_len=MAX_SEQ_LEN, max_num_seqs=12,
                                      prefix_eviction=self.PREFIX_EVICTION)
        self.tier = HostTier(self.manager, TIER_SLOTS)
        self.memory = tag_memory(self.manager)
        self.events = KVEventLog(epoch=1, capacity=1)
        self.events.attach(self.manager.allocator.cache)
        self.consumer, self.lagging = EventConsumer(), EventConsumer()
        self.host = np.full((TIER_SLOTS, BLOCK_SIZE), -1, dtype=np.int64)  # the tier's memory: tags
        self.host_model: dict[int, int] = {}  # slot -> the model block whose content it holds
        self.fail_next = False
        self.writebacks: list[np.ndarray] = []  # planned write-backs whose copy has not run yet (in flight)

    # The driver's part (offload/tier_copies.py): a plan's stores before anything writes into the evicted blocks.
    def run_stores(self, stores: StorePlan) -> None:
        tier = self.tier
        assert tier.offload_on_evict or not (stores.wait or len(stores.pairs))  # no copy on an eviction's path
        if stores.wait:  # an evicted block's write-back must be copied before anything writes into it
            self.finish_writebacks()
        pairs = stores.pairs
        if not len(pairs):
            return
        slots = pairs[:, 1].tolist()
        moved = pairs[: len(pairs) // 2] if self.fail_next else pairs
        for block, slot in moved.tolist():
            self.host[slot] = self.memory[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE]
            self.host_model[slot] = self.model_block[block]
        if self.fail_next:
            self.fail_next = False
            tier.abort(slots)
        else:
            tier.commit(slots)

    def execute(self, plan) -> None:
        self.run_stores(self.tier.prepare_store(plan.evicted))
        super().execute(plan)

    def finish_writebacks(self) -> None:
        """The in-flight write-backs' copies run now (the copy engine reads the blocks as they are now)."""
        tier = self.tier
        for pairs in self.writebacks:
            ok = not self.fail_next
            self.fail_next = False
            for block, slot in (pairs if ok else pairs[: len(pairs) // 2]).tolist():
                self.host[slot] = self.memory[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE]
                self.host_model[slot] = self.model_block[block]
            writeback.finish(tier, pairs, ok)
        self.writebacks = []

    @rule(max_blocks=st.integers(1, 4))
    def start_writeback(self, max_blocks):
        """The background write-back plans a batch; its copy runs later (``complete_writebacks``, or an eviction's
        wait)."""
        tier = self.tier
        if not self.writebacks:
            cache = self.manager.allocator.cache
            pairs = writeback.plan(tier, cache.evictable, cache.entries, max_blocks)
            if len(pairs):
                self.writebacks.append(pairs)

    @rule()
    def complete_writebacks(self):
        self.finish_writebacks()

    @rule()
    def stop_offloading_on_eviction(self):
        """The service's write-back thread starts: evictions copy nothing any more."""
        self.tier.offload_on_evict = False

    @rule()
    def fail_the_next_copy(self):
        self.fail_next = True

    @rule(data=st.data(), variant=st.integers(0, 1))
    def evict_a_prompt(self, data, variant):
        """A whole prompt prefilled, sealed and freed, then the pool turned over (two ``pressure`` sequences, freed
        again), so the tier takes it: the plain rules alone rarely fill the pool of 24 blocks."""
        if len(self.model.tags) >= 10:
            return
        before = set(self.model.tags)
        self.register_with_prefix(data, variant, 13)
        (seq_id,) = set(self.model.tags) - before
        self._append_with_ids(seq_id, [0])  # seals the prompt's full blocks
        self.same_sharing_as_reference()  # the model's view of the blocks, as after a step
        new = [seq_id]
        for _ in range(2):
            self.pressure()
            self.same_sharing_as_reference()
        new = sorted(set(self.model.tags) - before, key=list(self.model.tags).index)
        self.manager.free(new)
        for s in new:
            self.model.free(s)
        self.freed.extend(new)

    @rule(data=st.data(), variant=st.integers(0, 1), length=st.integers(1, 14), meanwhile=st.booleans())
    def register_with_prefix(self, data, variant, length, meanwhile=False):
        """Restore the prompt's tier blocks (or fail halfway), then register and append as the plain machine.
        ``meanwhile``: while the restore copies (the lock released), a write-back batch runs and the same prompt's
        staging is tried again."""
        if len(self.model.tags) >= 12:
            return
        prompt = [p if p < 6 else 100 * variant + p for p in range(length)]
        staged = restore.stage_prompt(self.tier, None, prompt)
        if staged is not None:
            self.run_stores(staged.stores)
        if staged is not None and meanwhile:
            self.manager.check_invariants()  # the staging's references and pinned slots are accounted for
            self.tier.check_invariants()
            assert restore.stage_prompt(self.tier, None, prompt) is None  # its slots are pinned: nothing taken
            self.start_writeback(2)
            self.finish_writebacks()
        if staged is not None:
            ok = not self.fail_next
            self.fail_next = False
            moved = staged.pairs if ok else staged.pairs[: len(staged.pairs) // 2]
            for slot, block in moved.tolist():
                self.memory[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE] = self.host[slot]
                if ok:
                    self.model_block[block] = self.host_model[slot]
            restore.finish(self.tier, staged, ok)
        super().register_with_prefix.__wrapped__(self, data, variant, length)  # type: ignore[attr-defined]

    @invariant()
    def event_consumers_index_equals_the_prefix_cache(self):
        batch = self.events.publish()
        if batch is not None:
            self.consumer.apply(batch)
        self.steps += 1
        expected = both_tiers(self.manager, self.tier)
        if self.steps % 10 == 0:
            missed = self.events.since(self.lagging.seq + 1)
            for b in missed if missed is not None else [self.events.snapshot(self.manager.allocator.cache, self.tier.stored_events())]:
                self.lagging.apply(b)
            assert self.lagging.blocks == expected
        assert self.consumer.blocks == expected

    @invariant()
    def matches_reference(self):
        super().matches_reference()  # (the manager's invariants: no eviction left out of its call's plan)
        self.tier.check_invariants()


def both_tiers(manager: KVCacheManager, tier: HostTier) -> dict:
    index = {tier.entries[s].block_hash: (None if tier.entries[s].parent_hash == NONE_HASH else
                                          tier.entries[s].parent_hash, tuple(tier.entries[s].token_ids.tolist()))
             for s in tier.slot_of_hash.values()}
    index.update(cache_index(manager.allocator.cache))
    return index


TieredMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTieredManagerAgainstReference = TieredMachine.TestCase


class LrfuTieredMachine(TieredMachine):
    """The same, the pool's prefix cache evicting by LRFU (the host tier keeps its own LRU)."""

    PREFIX_EVICTION = "lrfu"


LrfuTieredMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestTieredManagerAgainstReferenceLrfu = LrfuTieredMachine.TestCase
