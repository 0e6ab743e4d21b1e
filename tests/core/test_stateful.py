"""Model-based test: the vectorised manager against a plain sequential reference, step by step.

The reference keeps, per sequence, its token tags and a list of abstract block ids, and applies copy-on-write one
token at a time in batch order -- the obviously-correct semantics the batched planner must reproduce exactly
(free block counts, copies made). Token data lives in a tag memory written through the returned slots, so every
step also checks that each sequence reads back its own tokens through its page table.

Prefix caching: appends may carry token ids (from a tiny alphabet, so that equal blocks recur), and
``register_with_prefix`` starts a sequence from cached blocks. The model does not predict what is cached; it
follows the manager's choice (mapping physical blocks to its own through the live sequences' tables, a bijection
checked every step) and checks that every reused block holds the token ids asked for and reads back exactly the
tags its first writer wrote. Eviction under pressure: free + evictable must serve every append the model allows.
KV events: the manager's KVEventLog is published after every step (as the servicer publishes after every append);
one consumer applies every batch, another resumes every few steps (``since``, or a snapshot once it fell behind
the small buffer); both indexes must equal the prefix cache's entries.
"""

import itertools

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool_server.core import (
    InvalidArgumentError,
    KVCacheManager,
    OutOfBlocksError,
    SequenceExistsError,
    SequenceNotFoundError,
)

from kvpool_server.core.kv_events import KVEventLog

from .conftest import run_copies, snapshot, tag_memory
from .event_consumer import EventConsumer, cache_index

NUM_BLOCKS, BLOCK_SIZE, MAX_SEQ_LEN = 24, 4, 48


class ReferenceModel:
    """Sequential reference: one token at a time, copy a shared partial block before writing into it."""

    def __init__(self) -> None:
        self.tags: dict[int, list[int]] = {}
        self.blocks: dict[int, list[int]] = {}
        self.refs: dict[int, int] = {}
        self.copies = 0
        self.content: dict[int, list[int]] = {}  # block -> the tags written into it, in order
        self._next_block = itertools.count()

    def used(self) -> int:
        return sum(1 for r in self.refs.values() if r > 0)

    def blocks_needed(self, seq_ids: list[int], counts: list[int]) -> int:
        """Blocks an append would take, by dry-running it on copies of the model's state."""
        refs = dict(self.refs)
        needed = 0
        for seq_id, count in zip(seq_ids, counts):
            length, last = len(self.tags[seq_id]), (self.blocks[seq_id] or [None])[-1]
            if length % BLOCK_SIZE and refs[last] > 1:
                refs[last] -= 1
                needed += 1
            needed += -(-(length + count) // BLOCK_SIZE) - -(-length // BLOCK_SIZE)
        return needed

    def append(self, seq_id: int, new_tags: list[int]) -> None:
        blocks = self.blocks[seq_id]
        for tag in new_tags:
            length = len(self.tags[seq_id])
            if length % BLOCK_SIZE == 0:
                blocks.append(next(self._next_block))
                self.refs[blocks[-1]] = 1
                self.content[blocks[-1]] = []
            elif self.refs[blocks[-1]] > 1:
                self.refs[blocks[-1]] -= 1
                old = blocks[-1]
                blocks[-1] = next(self._next_block)
                self.refs[blocks[-1]] = 1
                self.content[blocks[-1]] = list(self.content[old])
                self.copies += 1
            self.tags[seq_id].append(tag)
            self.content[blocks[-1]].append(tag)

    def adopt(self, seq_id: int, blocks: list[int]) -> None:
        """A new sequence starting with the (full) ``blocks``, matched in the prefix cache."""
        self.blocks[seq_id] = list(blocks)
        self.tags[seq_id] = [tag for block in blocks for tag in self.content[block]]
        for block in blocks:
            self.refs[block] += 1

    def fork(self, parent: int, children: list[int]) -> None:
        for child in children:
            self.tags[child] = list(self.tags[parent])
            self.blocks[child] = list(self.blocks[parent])
            for block in self.blocks[parent]:
                self.refs[block] += 1

    def free(self, seq_id: int) -> None:
        for block in self.blocks.pop(seq_id):
            self.refs[block] -= 1
        del self.tags[seq_id]


class ManagerMachine(RuleBasedStateMachine):
    PREFIX_EVICTION = "lru"  # the prefix cache's eviction policy (LrfuMachine below: the same rules under LRFU)

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, max_seq_len=MAX_SEQ_LEN, max_num_seqs=12,
                                      prefix_eviction=self.PREFIX_EVICTION)
        self.memory = tag_memory(self.manager)
        self.model = ReferenceModel()
        self.freed: list[int] = []
        self.assigned: set[int] = set()
        self._tag = itertools.count(1)
        self.token_of_tag: dict[int, int] = {}  # tags written by appends that carried token ids
        self.model_block: dict[int, int] = {}  # physical block -> the model's, as of the last step
        self.events = KVEventLog(epoch=1, capacity=1)
        self.events.attach(self.manager.allocator.cache)
        self.consumer = EventConsumer()  # applies every batch
        self.lagging = EventConsumer()  # catches up every 10 steps: resumes, or takes a snapshot past the buffer
        self.steps = 0

    # KV memory: a tag per slot here; tests/device/test_stateful_pool.py runs the same machine on a real pool.
    def copy_blocks(self, copies: np.ndarray) -> None:
        run_copies(self.memory, copies, BLOCK_SIZE)

    def zero_blocks(self, block_ids: np.ndarray) -> None:
        for block_id in block_ids.tolist():
            self.memory[block_id * BLOCK_SIZE : (block_id + 1) * BLOCK_SIZE] = -1

    def hold_nothing(self, slots: np.ndarray) -> bool:
        """Whether ``slots`` hold no token's KV (cleared, or never written)."""
        return bool((self.memory[slots] == -1).all())

    def execute(self, plan) -> None:
        """The device layer's part of a plan, as documented: clear, then copy on write."""
        self.zero_blocks(plan.zero_block_ids)
        self.copy_blocks(plan.copies)

    def write_tags(self, slots: np.ndarray, tags: list[int]) -> None:
        self.memory[slots] = tags

    def read_tags(self, slots: np.ndarray) -> list[int]:
        return self.memory[slots].tolist()

    def live(self) -> list[int]:
        # In the order they were made, not by value: server ids start at a random serial every run, and a choice
        # that depended on their values would differ between hypothesis's replays of one example.
        return list(self.model.tags)

    def _fits(self, seq_ids: list[int], counts: list[int]) -> bool:
        return all(len(self.model.tags[s]) + c <= MAX_SEQ_LEN for s, c in zip(seq_ids, counts))

    @rule(caller_id=st.none() | st.integers(1, 2**64 - 2))
    def register(self, caller_id):
        if len(self.model.tags) >= 12:
            before = snapshot(self.manager)
            try:
                self.manager.register(caller_id)
            except (OutOfBlocksError, SequenceExistsError):
                assert snapshot(self.manager) == before
                return
            raise AssertionError("register past max_num_seqs succeeded")
        if caller_id in self.model.tags:
            before = snapshot(self.manager)
            try:
                self.manager.register(caller_id)
            except SequenceExistsError:
                assert snapshot(self.manager) == before
                return
            raise AssertionError("duplicate register succeeded")
        seq_id = self.manager.register(caller_id)
        assert caller_id is None or seq_id == caller_id
        assert seq_id not in self.model.tags
        if caller_id is None:
            assert seq_id not in self.assigned, "the manager handed out an id twice"
            self.assigned.add(seq_id)
        self.model.tags[seq_id], self.model.blocks[seq_id] = [], []

    @rule(data=st.data(), variant=st.integers(0, 1), length=st.integers(1, 14))
    def register_with_prefix(self, data, variant, length):
        """Register with a prompt (two variants sharing their first 6 tokens), then append the rest with ids."""
        if len(self.model.tags) >= 12:
            return
        prompt = [p if p < 6 else 100 * variant + p for p in range(length)]
        seq_id = self.manager.register(prompt_token_ids=prompt)
        cached = self.manager.num_tokens(seq_id)
        assert cached % BLOCK_SIZE == 0 and cached <= max(0, length - 1)
        blocks = [self.model_block[b] for b in self.manager.block_table(seq_id).tolist()]
        assert all(self.model.refs[b] == 0 or len(self.model.content[b]) == BLOCK_SIZE for b in blocks)
        self.model.adopt(seq_id, blocks)
        assert [self.token_of_tag[t] for t in self.model.tags[seq_id]] == prompt[:cached], "matched other tokens"
        if cached < length:
            self._append_with_ids(seq_id, prompt[cached:])

    def _append_with_ids(self, seq_id: int, token_ids: list[int]) -> None:
        enough = self.model.blocks_needed([seq_id], [len(token_ids)]) <= NUM_BLOCKS - self.model.used()
        before = snapshot(self.manager)
        try:
            plan = self.manager.append(seq_id, len(token_ids), token_ids=token_ids)
        except OutOfBlocksError:
            assert not enough and snapshot(self.manager) == before
            return
        assert enough, "append with token ids succeeded where the reference says it cannot"
        self.execute(plan)
        new_tags = [next(self._tag) for _ in token_ids]
        self.write_tags(plan.slot_mapping, new_tags)
        self.token_of_tag.update(zip(new_tags, token_ids))
        self.model.append(seq_id, new_tags)

    @rule()
    def pressure(self):
        """Eviction under pressure: a new sequence takes every allocatable block it can hold (free + evictable)."""
        if len(self.model.tags) >= 12:
            return
        seq_id = self.manager.register()
        self.model.tags[seq_id], self.model.blocks[seq_id] = [], []
        num_blocks = min(NUM_BLOCKS - self.model.used(), MAX_SEQ_LEN // BLOCK_SIZE)
        if num_blocks:
            plan = self.manager.append(seq_id, num_blocks * BLOCK_SIZE)
            self.execute(plan)
            new_tags = [next(self._tag) for _ in range(num_blocks * BLOCK_SIZE)]
            self.write_tags(plan.slot_mapping, new_tags)
            self.model.append(seq_id, new_tags)

    @precondition(lambda self: self.model.tags)
    @rule(data=st.data(), count=st.integers(1, 6))
    def append_with_ids(self, data, count):
        """Decode-like appends carrying ids (seals the sequence's filled blocks), from a 2-token alphabet."""
        seq_id = data.draw(st.sampled_from(self.live()))
        if len(self.model.tags[seq_id]) + count <= MAX_SEQ_LEN:
            self._append_with_ids(seq_id, data.draw(st.lists(st.integers(0, 1), min_size=count, max_size=count)))

    @precondition(lambda self: self.model.tags)
    @rule(data=st.data(), single=st.booleans())
    def append(self, data, single):
        live = self.live()
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        if single:
            chosen = chosen[:1]
        counts = data.draw(st.lists(st.integers(1, 9), min_size=len(chosen), max_size=len(chosen)))
        uniform = data.draw(st.booleans())
        if uniform:
            counts = [counts[0]] * len(counts)
        fits = self._fits(chosen, counts)
        enough = self.model.blocks_needed(chosen, counts) <= NUM_BLOCKS - self.model.used()
        before = snapshot(self.manager)
        try:
            if single:
                plan = self.manager.append(chosen[0], counts[0])
            else:
                plan = self.manager.append(chosen, counts[0] if uniform else counts)
        except InvalidArgumentError:
            assert not fits and snapshot(self.manager) == before
            return
        except OutOfBlocksError:
            assert fits and not enough and snapshot(self.manager) == before
            return
        assert fits and enough, "append succeeded where the reference says it cannot"
        self.execute(plan)
        new_tags = [next(self._tag) for _ in range(sum(counts))]
        self.write_tags(plan.slot_mapping, new_tags)
        start = 0
        for seq_id, count in zip(chosen, counts):
            self.model.append(seq_id, new_tags[start : start + count])
            start += count

    @precondition(lambda self: self.model.tags)
    @rule(data=st.data(), num_children=st.integers(1, 3))
    def fork(self, data, num_children):
        parent = data.draw(st.sampled_from(self.live()))
        before = snapshot(self.manager)
        try:
            children = self.manager.fork(parent, num_children)
            assert not self.assigned & set(children)
            self.assigned.update(children)
        except OutOfBlocksError:
            assert len(self.model.tags) + num_children > 12 and snapshot(self.manager) == before
            return
        assert len(self.model.tags) + num_children <= 12
        self.model.fork(parent, children)

    @precondition(lambda self: self.model.tags)
    @rule(data=st.data())
    def free(self, data):
        live = self.live()
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        self.manager.free(chosen)
        for seq_id in chosen:
            self.model.free(seq_id)
        self.freed.extend(chosen)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def misuse_freed(self, data):
        gone = data.draw(st.sampled_from(self.freed))
        if gone in self.model.tags:  # a caller re-registered the id
            return
        before = snapshot(self.manager)
        for call in (
            lambda: self.manager.free(gone),
            lambda: self.manager.fork(gone, 1),
            lambda: self.manager.append(gone),
            lambda: self.manager.append([*self.live()[:1], gone]),
        ):
            try:
                call()
            except SequenceNotFoundError:
                pass
            else:
                raise AssertionError("an operation on a freed sequence succeeded")
            assert snapshot(self.manager) == before

    @invariant()
    def same_sharing_as_reference(self):
        """Physical and model blocks correspond one to one through the live sequences' tables."""
        pairs = {(p, m) for s in self.model.tags
                 for p, m in zip(self.manager.block_table(s).tolist(), self.model.blocks[s])}
        assert len({p for p, _ in pairs}) == len(pairs) == len({m for _, m in pairs})
        self.model_block.update(pairs)

    @invariant()
    def event_consumers_index_equals_the_prefix_cache(self):
        batch = self.events.publish()
        if batch is not None:
            self.consumer.apply(batch)
        self.steps += 1
        if self.steps % 10 == 0:
            missed = self.events.since(self.lagging.seq + 1)
            for b in missed if missed is not None else [self.events.snapshot(self.manager.allocator.cache)]:
                self.lagging.apply(b)
            assert self.lagging.blocks == cache_index(self.manager.allocator.cache)
        assert self.consumer.blocks == cache_index(self.manager.allocator.cache)

    @invariant()
    def no_slot_shows_a_former_owners_kv(self):
        """Past each live sequence's last token its last block holds nothing: the blocks an append takes are
        cleared (``plan.zero_block_ids``), so freed KV never reaches the next owner (issue 20, item 1)."""
        for seq_id, tags in self.model.tags.items():
            used = len(tags) % BLOCK_SIZE
            if used:
                last = self.manager.block_table(seq_id).item(-1)
                assert self.hold_nothing(np.arange(last * BLOCK_SIZE + used, (last + 1) * BLOCK_SIZE)), (
                    f"sequence {seq_id}'s last block shows another owner's KV past its tokens")

    @invariant()
    def matches_reference(self):
        self.manager.check_invariants()
        stats = self.manager.stats()
        assert stats.num_blocks_used == self.model.used()
        assert stats.num_copies == self.model.copies
        assert stats.num_sequences == len(self.model.tags)
        for seq_id, tags in self.model.tags.items():
            assert self.manager.num_tokens(seq_id) == len(tags)
            if tags:
                read = self.read_tags(self.manager.slots(seq_id, 0, len(tags)))
                assert read == tags, f"sequence {seq_id} reads back other tokens"


ManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestManagerAgainstReference = ManagerMachine.TestCase


class LrfuMachine(ManagerMachine):
    """The same machine, the prefix cache evicting by LRFU (eviction_policy.py): the model follows the manager's
    choice of what stays cached, so every check holds under any policy."""

    PREFIX_EVICTION = "lrfu"


LrfuMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestManagerAgainstReferenceLrfu = LrfuMachine.TestCase


def test_tag_memory_distinguishes_sequences():
    """The data check above can fail: two sequences' tags differ in memory after divergence."""
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    memory = tag_memory(manager)
    seq = manager.register()
    memory[manager.append([seq], 3).slot_mapping] = [1, 2, 3]
    (child,) = manager.fork(seq, 1)
    plan = manager.append(child)
    memory[plan.slot_mapping] = 4  # without running the copy, the child loses its prefix
    assert memory[manager.slots(child, 0, 4)].tolist() != [1, 2, 3, 4]
    run_copies(memory, plan.copies, BLOCK_SIZE)
    assert np.array_equal(memory[manager.slots(seq, 0, 3)], [1, 2, 3])
