"""KVCacheManager: the sequences' face of the core -- ids to rows, validation, register / append / fork / free."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool_server.core import checks
from kvpool_server.core.allocator import BlockAllocator
from kvpool_server.core.block_tables import BlockTables
from kvpool_server.core.call_args import append_counts, append_token_ids
from kvpool_server.core.eviction_policy import make_eviction_policy
from kvpool_server.core.errors import FailedPreconditionError, InvalidArgumentError, SequenceExistsError
from kvpool_server.core.new_sequences import PromptInput, check_burst, per_register, prompt_of
from kvpool_server.core.prefix_reuse import PrefixReuse
from kvpool_server.core.session_members import SessionMembers
from kvpool_server.core.seq_index import SequenceIndex, check_caller_seq_id
from kvpool_server.core.tenant_blocks import plan_within_budget, release_rows
from kvpool_server.core.tenant_ids import TenantIds
from kvpool_server.core.tenants import DEFAULT_TENANT, TenantLedger
from kvpool_server.core.token_chains import TokenChains
from kvpool_server.core.types import AppendPlan, PoolStats


class KVCacheManager:
    """Page tables over a pool of ``num_blocks`` blocks of ``block_size`` tokens, with copy-on-write sharing.

    The manager resolves sequence ids to rows (``SequenceIndex``) and validates each request; the block tables plan
    on those rows and call the allocator (``BlockTables`` -> ``BlockAllocator``). The manager plans; the device layer
    executes: ``append`` returns an AppendPlan whose ``copies`` the caller must run on the pool
    (``pool.copy_blocks(plan.copies)``) before writing into the new slots.

    Fork shares blocks; the first write into a shared block (the partly filled last block included) copies it::

        parent  [A|B|C.]        fork        parent [A|B|C.]   append   parent [A|B|C*]  (writes C in place)
                                  ->        child  [A|B|C.]     ->     child  [A|B|C'*] (C copied to C' first)
                                            ref A=B=C=2                ref A=B=2, C=1, C'=1

    Every operation checks everything before it changes anything: an operation that raises leaves the manager
    exactly as it was. A batch that cannot be served in full is not served in part.

    A sequence may belong to a session (``register``/``fork`` with a ``session_id``; ``members``, a
    ``SessionMembers``): ``seq_ids_of_session`` is what a session's end frees.

    Every sequence belongs to a tenant (``tenants``, a ``TenantLedger``: an array entry per row). With ``tenancy``
    on, the calls take the caller's ``tenant``: a sequence of another tenant is NOT_FOUND, exactly as one that does
    not exist, and appends are budgeted by the tenant's quotas. ``tenant=None`` is a trusted caller (a session's
    end, tests) that may name any tenant's sequences. With ``tenancy`` off every sequence is tenant 0's, unchecked.

    Ids (docs/security.md): with ``tenancy`` on, each tenant names its sequences in a namespace of its own
    (``tenant_ids``, a ``TenantIds``): a call with ``tenant=t`` takes and returns t's ids, and no answer depends on
    another tenant's ids. The index then holds a server-assigned internal id for every row, the id a trusted call
    (``tenant=None``) takes and returns (``seq_ids_of_session`` and ``members`` hold internal ids); a
    caller-chosen id of a trusted register is tenant 0's. With ``tenancy`` off the index holds the callers' ids
    themselves, as one namespace.

    Prefix caching (docs/prefix-caching.md): appends may carry their token ids (``token_ids``); full blocks of such
    sequences are hashed (``TokenChains``), sealed with the sequence's next append and then matchable
    (``allocator.cache``, a ``PrefixCache``); ``register`` with ``prompt_token_ids`` starts the sequence with the
    longest cached run (``prefix``, a ``PrefixReuse``: salted by tenant, counted). A host tier (``offload``) is no
    part of the manager: with ``allocator.cache.keep_evictions()`` an append's plan names the blocks it evicted
    (``AppendPlan.evicted``), and the tier's restores hold their pool blocks in ``held_outside``.

    Invariants (``check_invariants``, which also checks the index's, the tables' and the allocator's): a row of the
    tables is in use iff the index names a live sequence that holds it or it is one of ``detached_rows`` (a freed
    sequence's, its blocks not yet released: ``detach``); every block reference no row holds is one of
    ``held_outside``'s (by a caller between two calls: a host-tier restore in flight).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_seq_len: int | None = None,
        max_num_seqs: int = 4096,
        tenancy: bool = False,
        prefix_eviction: str = "lru",
        prefix_half_life_tokens: int | None = None,
    ) -> None:
        if block_size < 1:
            raise InvalidArgumentError(f"block_size must be >= 1, got {block_size}")
        self.block_size: int = block_size
        self.num_blocks: int = num_blocks
        self.max_seq_len: int = max_seq_len if max_seq_len is not None else min(num_blocks * block_size, 1 << 15)
        if self.max_seq_len < 1:
            raise InvalidArgumentError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        self.index: SequenceIndex = SequenceIndex(max_num_seqs)  # checks max_num_seqs
        # The prefix cache's eviction policy by name (eviction_policy.PREFIX_EVICTION_POLICIES; checked) and LRFU's
        # half-life (None: its default).
        policy = make_eviction_policy(prefix_eviction, num_blocks, block_size, prefix_half_life_tokens)
        self.allocator: BlockAllocator = BlockAllocator(num_blocks, policy)
        self.tables: BlockTables = BlockTables(block_size, self.max_seq_len, max_num_seqs, self.allocator)
        self.members: SessionMembers = SessionMembers()  # which session holds which sequence
        self.tenancy: bool = tenancy
        self.tenants: TenantLedger = TenantLedger(max_num_seqs)
        self.tenant_ids: TenantIds = TenantIds(max_num_seqs, self.index.row_bits)  # used with tenancy on
        self.chains: TokenChains = TokenChains(block_size, max_num_seqs)
        self.detached_rows: set[int] = set()  # rows of freed sequences whose blocks are not released yet (detach)
        # key -> pool blocks a caller holds one reference to each of, outside any table, between two calls (a host
        # tier's restore being copied: ``offload.restore``); counted by check_invariants.
        self.held_outside: dict[int, np.ndarray] = {}
        self._evicted: list[int] = self.allocator.cache.evicted_ids  # this call's evictions (keep_evictions)
        self.prefix: PrefixReuse = PrefixReuse(self.tables, self.tenants, self.chains, tenancy, self.max_seq_len)

    # ---------------------------------------------------------------- sequences
    @property
    def num_sequences(self) -> int:
        return len(self.index)

    @property
    def num_copies(self) -> int:
        """Copy-on-write copies planned so far."""
        return self.tables.num_copies

    def register(self, seq_id: int | None = None, session_id: int = 0, tenant: int | None = None,
                 prompt_token_ids: Sequence[int] | np.ndarray | None = None, public_prefix_len: int = 0,
                 cache_extra_key: bytes = b"", prompt_hashes: list[bytes] | None = None) -> int:
        """Create a sequence (of ``session_id``, 0: none; of ``tenant``, None: the default); the manager assigns the
        id unless one is given. With ``prompt_token_ids`` it starts with the longest run of the prompt's full
        blocks that are cached (``num_tokens`` says how many tokens: the caller appends the rest), and is tracked.
        The prompt's first ``public_prefix_len`` tokens (their full blocks) are a public prefix, shared across
        tenants; ``cache_extra_key`` goes into every block's hash (docs/prefix-caching.md). ``prompt_hashes``: the
        prompt's ``prefix.prompt_hashes`` for this tenant, computed off the lock (else hashed here)."""
        prompt = prompt_of(prompt_token_ids, public_prefix_len, cache_extra_key, self.max_seq_len)
        scoped = self.tenancy and tenant is not None  # the caller names sequences in its tenant's namespace
        tenant = DEFAULT_TENANT if tenant is None or not self.tenancy else tenant
        self.tenants.check_new_sequences(tenant, 1)
        if seq_id is not None:
            self._check_new_id(seq_id, tenant)
        row = self.tables.acquire_row()
        internal = seq_id if seq_id is not None and not self.tenancy else self.index.new_server_id(row)
        named = self.tenant_ids.add(tenant, row, seq_id) if self.tenancy else internal  # the tenant's id
        self.index.add(internal, row)
        self.members.own([internal], session_id)
        self.tenants.add_rows([row], tenant)
        if prompt is not None:
            self.prefix.start(row, tenant, prompt, public_prefix_len, cache_extra_key, prompt_hashes)
        return named if scoped else internal

    def register_many(self, num: int, session_id: int = 0, tenant: int | None = None,
                      seq_ids: Sequence[int] | None = None, prompt_token_ids: Sequence[PromptInput] | None = None,
                      public_prefix_lens: Sequence[int] | None = None, cache_extra_keys: Sequence[bytes] | None = None,
                      prompt_hashes: Sequence[list[bytes] | None] | None = None) -> list[int]:
        """``num`` registers in one call, all or none: the ids ``[register(seq_ids[i], session_id, tenant,
        prompt_token_ids[i], public_prefix_lens[i], cache_extra_keys[i], prompt_hashes[i]) for i in range(num)]``
        would return (a list left None: that argument's default for all), or -- nothing registered -- the refusal
        of the first of them that would be refused (``new_sequences.check_burst``). Rows, ids, the index, the
        sessions and the tenant ledger are written once for all; each prompt is looked up as ``register`` does."""
        if num < 0:
            raise InvalidArgumentError(f"register_many needs num >= 0 new sequences, got {num}")
        for values, name in ((seq_ids, "seq_ids"), (prompt_token_ids, "prompts"), (prompt_hashes, "prompt_hashes"),
                             (public_prefix_lens, "public_prefix_lens"), (cache_extra_keys, "cache_extra_keys")):
            per_register(values, num, name)
        scoped = self.tenancy and tenant is not None
        tenant = DEFAULT_TENANT if tenant is None or not self.tenancy else tenant
        taken = (lambda s: self.tenant_ids.holds(tenant, s)) if self.tenancy else self.index.__contains__
        prompts = check_burst(num, tenant, self.tenants, self.tables, self.max_seq_len, seq_ids, taken,
                              prompt_token_ids, public_prefix_lens, cache_extra_keys)
        if not num:
            return []
        rows = self.tables.acquire_rows(num)
        row_array = np.array(rows, dtype=np.intp)
        if seq_ids is None or self.tenancy:  # internal ids are server ids
            internal = named = self.index.add_server_ids(rows, row_array)
        else:
            internal = named = [int(s) for s in seq_ids]
            self.index.add_many(internal, rows)
        if self.tenancy:
            chosen: Sequence[int | None] = [None] * num if seq_ids is None else seq_ids
            named = [self.tenant_ids.add(tenant, row, seq_id) for row, seq_id in zip(rows, chosen)]
        self.members.own(internal, session_id)
        self.tenants.add_rows(row_array, tenant)
        if public_prefix_lens is None and cache_extra_keys is None and prompt_hashes is None:
            if prompt_token_ids is not None:  # a burst of plain prompts: their lookups in one pass
                self.prefix.start_many(rows, tenant, prompts)
            return named if scoped else internal
        for i, prompt in enumerate(prompts if prompt_token_ids is not None or cache_extra_keys is not None else ()):
            if prompt is not None:
                self.prefix.start(rows[i], tenant, prompt, 0 if public_prefix_lens is None else public_prefix_lens[i],
                                  b"" if cache_extra_keys is None else cache_extra_keys[i],
                                  None if prompt_hashes is None else prompt_hashes[i])
        return named if scoped else internal

    def _check_new_id(self, seq_id: int, tenant: int) -> None:
        """A caller-chosen id must be free -- in the tenant's own namespace, with tenancy on."""
        if self.tenant_ids.holds(tenant, seq_id) if self.tenancy else seq_id in self.index:
            raise SequenceExistsError(f"sequence {seq_id} already exists")
        check_caller_seq_id(seq_id)

    def append(
        self, seq_ids: int | Sequence[int] | np.ndarray, num_new_tokens: int | Sequence[int] = 1,
        tenant: int | None = None, token_ids: Sequence[int] | np.ndarray | None = None,
    ) -> AppendPlan:
        """Append ``num_new_tokens`` (one count for all, or one per sequence) to one sequence or a batch, atomically.

        ``seq_ids`` is one id, or a non-empty sequence or uint64 array of distinct ids. Slots in
        ``plan.slot_mapping`` are grouped by sequence in the order of ``seq_ids``. ``token_ids``: every appended
        token's id, concatenated in that order, or None (the sequences are then not cached from here on).

        One pipeline: resolve the ids and counts (once), plan on the tables within the tenant's budget (passed
        down as an argument), then, when token ids are given or some row is tracked, extend the token chains.
        """
        # ``__class__ is`` tests: the cheapest on the hot path; mypy cannot narrow them (the ignores below; no
        # typing.cast, which is a call)
        if self.tenancy and tenant is not None:  # the tenant's own ids: its rows by construction
            rows = self.tenant_ids.resolve(tenant, seq_ids)
        else:
            rows = self.index.row(seq_ids) if seq_ids.__class__ is int else self.index.resolve(seq_ids)
        if num_new_tokens.__class__ is not int or num_new_tokens < 1:  # an array of counts, or a count to refuse
            num_new_tokens = append_counts(num_new_tokens, 1 if rows.__class__ is int else rows.size)  # type: ignore[union-attr]
        if token_ids is None and not self.chains.chains:  # nothing to track (a dict's truth: the cheapest test)
            if self.tenancy:
                plan = plan_within_budget(self.tables, self.tenants, seq_ids, rows,
                                          num_new_tokens, tenant)  # type: ignore[arg-type]
            else:
                plan = self.tables.plan_append(rows, num_new_tokens)  # type: ignore[arg-type]
            return plan._replace(evicted=self.allocator.cache.take_evicted()) if self._evicted else plan
        return self._append_tracked(seq_ids, rows, num_new_tokens, tenant, token_ids)  # type: ignore[arg-type]

    def _append_tracked(self, seq_ids: object, rows: int | np.ndarray, num_new_tokens: int | np.ndarray,
                        tenant: int | None, token_ids: Sequence[int] | np.ndarray | None) -> AppendPlan:
        """``append`` when token ids are given or some rows are tracked: the plan, then the chains
        (``TokenChains.after_append``: seal the rows' pending blocks, hash their new full ones)."""
        row_array = np.atleast_1d(np.asarray(rows, dtype=np.intp))
        if token_ids is None:
            ids = None
        else:  # one count for all (an int: no array to sum on the decode step), or one per row
            total = num_new_tokens * row_array.size if num_new_tokens.__class__ is int else int(num_new_tokens.sum())  # type: ignore[union-attr]
            ids = append_token_ids(token_ids, total)
        lengths = self.tables.num_tokens.take(row_array)
        if self.tenancy:
            plan = plan_within_budget(self.tables, self.tenants, seq_ids, rows, num_new_tokens, tenant)
        else:
            plan = self.tables.plan_append(rows, num_new_tokens)
        ledger = self.tenants
        sealed_public = self.chains.after_append(row_array, num_new_tokens, lengths, ids, self.tables.table,
                                                 self.allocator.cache, self._salt_of_row)
        if self.tenancy:
            for row, block_id in sealed_public:
                ledger.seal_public(ledger.tenant_of_row.item(row), block_id, self.allocator.ref_count.item(block_id))
        return plan._replace(evicted=self.allocator.cache.take_evicted()) if self._evicted else plan

    def _salt_of_row(self, row: int) -> bytes:
        """The salt of the blocks of ``row``'s sequence: its tenant's name, UTF-8."""
        return self.tenants.names[self.tenants.tenant_of_row.item(row)].encode()

    def _row(self, seq_id: int, tenant: int | None) -> int:
        """The row of the caller's (``tenant``'s) sequence ``seq_id``, named in its namespace with tenancy on;
        of the sequence of internal id ``seq_id`` for a trusted caller (None)."""
        if tenant is not None and self.tenancy:
            return self.tenant_ids.row(tenant, seq_id)
        return self.index.row(seq_id)

    def fork(
        self, parent_seq_id: int, num_children: int = 0, child_seq_ids: Sequence[int] = (), session_id: int = 0,
        tenant: int | None = None,
    ) -> list[int]:
        """Make children that share every block of the parent (ref counts go up, nothing is copied). The children
        belong to ``session_id``, or (0) to the parent's session, and always to the parent's tenant."""
        parent_row = self._row(parent_seq_id, tenant)
        parent_tenant = self.tenants.tenant_of_row.item(parent_row)
        child_seq_ids = list(child_seq_ids)
        if child_seq_ids:
            if num_children not in (0, len(child_seq_ids)):
                raise InvalidArgumentError(
                    f"num_children={num_children} but {len(child_seq_ids)} child_seq_ids were given"
                )
            for seq_id in child_seq_ids:
                self._check_new_id(seq_id, parent_tenant)
            if len(set(child_seq_ids)) != len(child_seq_ids):
                raise InvalidArgumentError("child_seq_ids repeat an id")
            num_children = len(child_seq_ids)
        elif num_children < 1:
            raise InvalidArgumentError(f"num_children must be >= 1, got {num_children}")
        self.tenants.check_new_sequences(parent_tenant, num_children)
        rows = self.tables.acquire_rows(num_children)
        chosen: list[int | None] = list(child_seq_ids) or [None] * num_children
        if self.tenancy:
            internal = [self.index.new_server_id(row) for row in rows]
            named = [self.tenant_ids.add(parent_tenant, row, seq_id) for row, seq_id in zip(rows, chosen)]
        else:
            internal = named = child_seq_ids or [self.index.new_server_id(row) for row in rows]
        self.tables.fork(parent_row, rows)
        self.chains.fork(parent_row, rows)
        if self.tenancy and self.allocator.cache.num_public:  # the children hold the parent's public blocks too
            blocks = self.tables.blocks_of(parent_row)
            public = blocks[self.allocator.cache.is_public[blocks]]
            if public.size:
                self.tenants.adopt_public(parent_tenant, public.tolist(), num_children)
        for seq_id, row in zip(internal, rows):
            self.index.add(seq_id, row)
        parent_internal = self.index.row_to_id.item(parent_row)
        self.members.own(internal, session_id or self.members.session_of_seq.get(parent_internal, 0))
        self.tenants.add_rows(rows, parent_tenant)
        return named if self.tenancy and tenant is not None else internal

    def free(self, seq_ids: int | Sequence[int], tenant: int | None = None) -> int:
        """Release sequences, all or none; blocks whose ref count reaches 0 are reusable at once.

        Returns the number of blocks freed (credited back to the tenants that held them). ``detach`` then
        ``release_detached`` of every row: a caller that must bound how long it holds the manager calls the two
        itself and releases the rows in parts, between which the manager is consistent.
        """
        return self.release_detached(self.detach(seq_ids, tenant))

    def detach(self, seq_ids: int | Sequence[int], tenant: int | None = None) -> list[int]:
        """The first half of ``free``, all or none: the sequences are no longer live (every call naming them gets
        NOT_FOUND, no session holds them) but their rows keep their blocks, their tenant and their token chains
        until ``release_detached``. Returns the rows (``detached_rows`` until released)."""
        ids = [seq_ids] if isinstance(seq_ids, int) else [int(s) for s in seq_ids]
        if not ids:
            raise InvalidArgumentError("free needs at least one seq_id")
        rows = [self._row(seq_id, tenant) for seq_id in ids]
        if len(rows) > 1 and len(set(rows)) != len(rows):
            raise InvalidArgumentError("free names a sequence twice")
        internal = self.index.row_to_id[rows].tolist()
        if self.tenancy:  # the tenant's names go at once (a caller-chosen one may be reused)
            for row, owner in zip(rows, self.tenants.tenant_of_row[rows].tolist()):
                self.tenant_ids.remove(owner, row)
        for seq_id in internal:
            self.index.remove(seq_id)
        self.members.disown(internal)
        self.detached_rows.update(rows)
        return rows

    def release_detached(self, rows: list[int]) -> int:
        """Drop the blocks of ``rows`` (distinct, detached) and make the rows free. Returns the blocks freed."""
        num_freed = release_rows(self.tables, self.tenants, self.tenancy, rows)
        self.chains.drop(rows)
        self.detached_rows.difference_update(rows)
        return num_freed

    # ---------------------------------------------------------------- sessions
    def seq_ids_of_session(self, session_id: int) -> list[int]:
        """The live sequences of a session (what its end frees), by internal id (a trusted caller's)."""
        return self.members.seq_ids(session_id)

    # ---------------------------------------------------------------- lookups
    def num_tokens(self, seq_id: int, tenant: int | None = None) -> int:
        """How many tokens the sequence holds."""
        return self.tables.num_tokens.item(self._row(seq_id, tenant))

    def block_table(self, seq_id: int, tenant: int | None = None) -> np.ndarray:
        """A copy of the sequence's block ids, logical order."""
        return self.tables.blocks_of(self._row(seq_id, tenant)).copy()

    def slots(
        self, seq_id: int, start: int, count: int, for_write: bool = False, tenant: int | None = None
    ) -> np.ndarray:
        """Slots of tokens [start, start + count) of a sequence.

        With ``for_write``, every block touched must be this sequence's alone (ref count 1): writing into a shared
        block would change the other sequences' KV, so it raises FailedPreconditionError.
        """
        row = self._row(seq_id, tenant)
        length = self.tables.num_tokens.item(row)
        if start < 0 or count < 1 or start + count > length:
            raise InvalidArgumentError(
                f"tokens [{start}, {start + count}) are outside sequence {seq_id} of {length} tokens"
            )
        slots = self.tables.slots(row, slice(start, start + count))
        if for_write and (self.allocator.ref_count[slots // self.block_size] > 1).any():
            raise FailedPreconditionError(
                f"tokens [{start}, {start + count}) of sequence {seq_id} lie in blocks shared with other "
                "sequences; append to the sequence (copy-on-write) before writing there"
            )
        if for_write and self.allocator.cache.num_cached and self.allocator.cache.is_cached[slots // self.block_size].any():
            raise FailedPreconditionError(
                f"tokens [{start}, {start + count}) of sequence {seq_id} lie in sealed cached blocks, which others may "
                "match: their KV is immutable"
            )
        return slots

    def stats(self) -> PoolStats:
        return checks.stats(self)

    def check_invariants(self) -> None:
        checks.check_invariants(self)
