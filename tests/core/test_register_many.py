"""``KVCacheManager.register_many``: a burst of registers is N single ``register`` calls, all or none.

The differential test drives two copies of one manager through random bursts (with and without prompts, some
sharing a cached prefix, some public, with extra keys, caller-chosen ids among them -- taken, repeated, out of
range --, bad prompts, tenants at their ``max_sequences``, the server at ``max_num_seqs``), interleaved with
prefills, decode steps and frees: on one copy the burst is one ``register_many``, on the other N ``register``
calls in order. Either every single register succeeds and the two copies then hold exactly the same state (ids,
rows, tables, chains, kept prompt hashes, cache, ledger, namespaces, sessions, counters), or one is refused: then
``register_many`` raises the same exception type and leaves its manager exactly as it was.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvpool_server.core import (
    InvalidArgumentError,
    InvariantViolationError,
    KVCacheManager,
    KVPoolError,
    OutOfBlocksError,
    SequenceExistsError,
)
from kvpool_server.core.errors import QuotaExceededError
from kvpool_server.core.tenants import TenantLimits

BS = 4


def state(manager: KVCacheManager) -> tuple:
    """Everything a register writes or reads, as comparable values."""
    tables, allocator, cache, ledger = manager.tables, manager.allocator, manager.allocator.cache, manager.tenants
    chains = manager.chains
    spaces = {t: (dict(s.row_of), dict(s.slot_of_row), s.slot_to_id.tobytes(), s.slot_to_row.tobytes(),
                  list(s.free_slots), s.next_serial) for t, s in manager.tenant_ids.spaces.items()}
    chain_fields = {row: (c.salt, c.num_sealed, c.sealed_hash, [(b.block_hash, b.parent_hash, b.token_ids.tobytes())
                                                                   for b in c.pending], c.extra, c.num_public, c.header,
                          c.public_header) for row, c in chains.chains.items()}
    return (
        sorted((s, manager.index.row(s)) for s in manager.index.seq_ids()), manager.index.row_to_id.tobytes(),
        manager.index._next_serial,
        tables.table.tobytes(), tables.num_tokens.tobytes(), tables.next_slot.tobytes(), tables.free_rows(),
        allocator.ref_count.tobytes(), allocator.free_block_ids().tobytes(), dict(cache.block_of_hash),
        list(cache.evictable), cache.is_public.tobytes(),
        ledger.num_sequences, ledger.num_blocks, ledger.tenant_of_row.tobytes(), dict(ledger.public_refs),
        manager.tenant_ids.id_of_row.tobytes(), spaces,
        dict(manager.members.session_of_seq), chain_fields, dict(chains.prompts.entries),
        chains.prompts.num_bytes, chains.tracked.tobytes(),
        manager.prefix.query_tokens, manager.prefix.hit_tokens,
    )


class Burst:
    """Random bursts and the other calls around them, on a manager and its twin."""

    def __init__(self, seed: int, tenancy: bool) -> None:
        self.rng = np.random.default_rng(seed)
        self.manager = KVCacheManager(num_blocks=512, block_size=BS, max_seq_len=64, max_num_seqs=24,
                                      tenancy=tenancy)
        self.tenants: list[int | None] = [None]
        if tenancy:
            self.tenants += [self.manager.tenants.tenant_id(name) for name in ("a", "b")]
            self.manager.tenants.set_limits(self.tenants[1], TenantLimits(max_sequences=9))
            for tenant in (0, *self.tenants[1:]):  # made now: a namespace's serial starts at random (its first use)
                self.manager.tenant_ids._space(tenant)
        self.live: dict[int | None, list[int]] = {t: [] for t in self.tenants}
        self.num_refused: dict[str, int] = {}
        self.num_applied = 0

    def prompt(self) -> list[int] | np.ndarray:
        shared = self.rng.random() < 0.5  # from a small family: later prompts find earlier ones' blocks cached
        n = int(self.rng.integers(0, 30))
        tokens = (np.arange(n) % 7 + 1).tolist() if shared else self.rng.integers(0, 1000, size=n).tolist()
        if self.rng.random() < 0.03:
            tokens = list(range(65))  # over max_seq_len: INVALID_ARGUMENT
        return np.array(tokens, dtype=np.uint32) if self.rng.random() < 0.5 else tokens

    def burst_args(self, tenant: int | None) -> dict:
        rng, num = self.rng, int(self.rng.integers(0, 9))
        args: dict = {"num": num, "tenant": tenant, "session_id": int(rng.choice([0, 0, 5]))}
        if rng.random() < 0.3:
            held = self.live[tenant]
            ids = [int(rng.integers(1, 40)) for _ in range(num)]
            for i in range(num):
                draw = rng.random()
                if draw < 0.05 and held:
                    ids[i] = held[int(rng.integers(len(held)))]  # taken
                elif draw < 0.1 and i:
                    ids[i] = ids[i - 1]  # the same id twice in one burst
                elif draw < 0.12:
                    ids[i] = 0  # out of range
            args["seq_ids"] = ids
        if rng.random() < 0.6:
            prompts = [self.prompt() for _ in range(num)]
            args["prompt_token_ids"] = [None if rng.random() < 0.1 else p for p in prompts]
            if rng.random() < 0.3:
                args["public_prefix_lens"] = [int(rng.integers(0, 1 + (0 if p is None else len(p))))
                                              for p in args["prompt_token_ids"]]
            if rng.random() < 0.3:
                args["cache_extra_keys"] = [b"lora" if rng.random() < 0.5 else b"" for _ in range(num)]
            if rng.random() < 0.3:  # computed before the call, as the service does off the lock
                public, keys = args.get("public_prefix_lens", [0] * num), args.get("cache_extra_keys", [b""] * num)
                args["prompt_hashes"] = [None if p is None or len(p) > 64 or rng.random() < 0.5 else
                                         self.manager.prefix.prompt_hashes(tenant, p, n, k)
                                         for p, n, k in zip(args["prompt_token_ids"], public, keys)]
        elif rng.random() < 0.2:
            args["cache_extra_keys"] = [b"k" * int(rng.integers(0, 3)) for _ in range(num)]
        return args

    def burst(self) -> None:
        tenant = self.tenants[int(self.rng.integers(len(self.tenants)))]
        args = self.burst_args(tenant)
        twin = copy.deepcopy(self.manager)
        expected: list[int] | KVPoolError = []
        try:
            for i in range(args["num"]):
                one = {"seq_id": None if "seq_ids" not in args else args["seq_ids"][i]}
                for key, name in (("prompt_token_ids", "prompt_token_ids"), ("public_prefix_lens", "public_prefix_len"),
                                  ("cache_extra_keys", "cache_extra_key"), ("prompt_hashes", "prompt_hashes")):
                    if key in args:
                        one[name] = args[key][i]
                expected.append(twin.register(session_id=args["session_id"], tenant=tenant, **one))
        except KVPoolError as error:
            expected = error
        before = state(self.manager)
        if isinstance(expected, KVPoolError):
            with pytest.raises(type(expected)):
                self.manager.register_many(**args)
            assert state(self.manager) == before, "a refused burst changed the manager"
            self.num_refused[type(expected).__name__] = self.num_refused.get(type(expected).__name__, 0) + 1
        else:
            assert self.manager.register_many(**args) == expected
            assert state(self.manager) == state(twin)
            self.live[tenant] += expected
            self.num_applied += len(expected)
        self.manager.check_invariants()

    def other(self) -> None:
        """A prefill or decode step of some live sequences of one tenant, or a free."""
        rng, manager = self.rng, self.manager
        tenant = self.tenants[int(rng.integers(len(self.tenants)))]
        held = self.live[tenant]
        if not held:
            return
        chosen = [held[i] for i in sorted(rng.choice(len(held), size=int(rng.integers(1, len(held) + 1)),
                                                     replace=False).tolist())]
        if rng.random() < 0.3:
            manager.free(chosen, tenant)
            self.live[tenant] = [s for s in held if s not in chosen]
            return
        counts = [int(rng.integers(1, 9)) for _ in chosen]
        if any(manager.num_tokens(s, tenant) + c > 64 for s, c in zip(chosen, counts)):
            return
        tokens = (np.arange(sum(counts)) % 7 + 1).tolist() if rng.random() < 0.8 else None
        manager.append(chosen, counts, tenant, token_ids=tokens)


@pytest.mark.parametrize("tenancy", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_a_burst_is_n_single_registers_all_or_none(seed: int, tenancy: bool) -> None:
    model = Burst(seed, tenancy)
    for _ in range(250):
        model.burst() if model.rng.random() < 0.5 else model.other()
    assert model.num_applied > 100
    assert {"InvalidArgumentError", "SequenceExistsError", "OutOfBlocksError"} <= set(model.num_refused)
    if tenancy:
        assert "QuotaExceededError" in model.num_refused


def test_a_burst_refused_part_way_registers_nothing() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS, max_seq_len=32)
    before = state(manager)
    prompts = [list(range(10)), list(range(20, 30)), list(range(40))]  # the third is over max_seq_len
    with pytest.raises(InvalidArgumentError, match="over max_seq_len"):
        manager.register_many(3, prompt_token_ids=prompts)
    assert state(manager) == before and manager.prefix.query_tokens == 0  # no prompt was looked up
    manager.check_invariants()


def test_duplicate_ids_in_one_burst_are_already_exists() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    held = manager.register(5)
    before = state(manager)
    with pytest.raises(SequenceExistsError, match="sequence 7 already exists"):
        manager.register_many(3, seq_ids=[6, 7, 7])
    with pytest.raises(SequenceExistsError, match=f"sequence {held} already exists"):
        manager.register_many(2, seq_ids=[8, held])
    assert state(manager) == before
    assert manager.register_many(2, seq_ids=[6, 7]) == [6, 7]
    manager.check_invariants()


def test_a_tenants_quota_reached_mid_burst_refuses_the_burst_whole() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS, tenancy=True)
    a = manager.tenants.tenant_id("a")
    manager.tenants.set_limits(a, TenantLimits(max_sequences=4))
    manager.register(tenant=a)
    before = state(manager)
    with pytest.raises(QuotaExceededError, match="max_sequences=4"):
        manager.register_many(4, tenant=a, prompt_token_ids=[[1, 2, 3, 4, 5]] * 4)
    assert state(manager) == before and manager.tenants.num_sequences[a] == 1
    # the first refusal of N single registers decides: the quota refuses register 3 (0-based), after checking its
    # own arguments (a prompt over max_seq_len=256 there is INVALID_ARGUMENT), before register 4's
    with pytest.raises(InvalidArgumentError, match="over max_seq_len"):
        manager.register_many(4, tenant=a, prompt_token_ids=[[1], [1], [1], [1] * 300])
    with pytest.raises(QuotaExceededError):
        manager.register_many(5, tenant=a, prompt_token_ids=[[1], [1], [1], [1], [1] * 300])
    assert state(manager) == before
    assert len(manager.register_many(3, tenant=a)) == 3 and manager.tenants.num_sequences[a] == 4
    manager.check_invariants()


def test_max_num_seqs_reached_mid_burst_refuses_it_whole() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS, max_num_seqs=6)
    manager.register_many(2)
    before = state(manager)
    with pytest.raises(OutOfBlocksError, match="max_num_seqs=6"):
        manager.register_many(5)
    assert state(manager) == before
    assert len(manager.register_many(4)) == 4 and manager.num_sequences == 6
    manager.check_invariants()


def test_per_register_arguments_must_match_the_count() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    with pytest.raises(InvalidArgumentError, match="2 prompts for 3 new sequences"):
        manager.register_many(3, prompt_token_ids=[[1], [2]])
    with pytest.raises(InvalidArgumentError):
        manager.register_many(-1)
    assert manager.register_many(0) == [] and manager.num_sequences == 0


def test_a_burst_with_prompts_finds_cached_blocks_and_keeps_the_rest_for_the_prefill() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    first = manager.register(prompt_token_ids=list(range(9)))
    manager.append(first, 9, token_ids=list(range(9)))
    manager.append(first, 1, token_ids=[99])  # seals blocks 0 and 1
    ids = manager.register_many(2, prompt_token_ids=[list(range(9)) + [5], list(range(50, 59))], session_id=3)
    assert [manager.num_tokens(s) for s in ids] == [8, 0]
    assert manager.seq_ids_of_session(3) == sorted(ids)
    row = manager.index.row(ids[1])
    assert len(manager.chains.prompts.entries[row].hashes) == 2  # its prefill hashes nothing again
    manager.check_invariants()


@pytest.mark.parametrize("corrupt", ["index", "ledger", "session", "namespace"])
def test_check_invariants_catches_a_burst_written_half(corrupt: str) -> None:
    """What a burst writes once for all -- the index, the ledger, the sessions, the tenant's namespace -- is what
    check_invariants reads: a burst that left one of them unwritten for a row is caught."""
    manager = KVCacheManager(num_blocks=64, block_size=BS, tenancy=True)
    a = manager.tenants.tenant_id("a")
    ids = manager.register_many(4, session_id=9, tenant=a)
    manager.check_invariants()
    row = manager.tenant_ids.row(a, ids[2])
    internal = manager.index.row_to_id.item(row)
    if corrupt == "index":
        manager.index.row_to_id[row] = row ^ 1
    elif corrupt == "ledger":
        manager.tenants.tenant_of_row[row] = 0
    elif corrupt == "session":
        manager.members.seqs_of_session[9].discard(internal)
    else:
        del manager.tenant_ids.spaces[a].row_of[ids[2]]
    with pytest.raises(InvariantViolationError):
        manager.check_invariants()
