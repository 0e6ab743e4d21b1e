"""KVPoolService: every KVPoolService RPC as a plain method -- plain arguments in, plain answers out, no protobuf.

    answer = service.append(call, seq_ids, num_tokens, token_ids, session_id, request_id)   # an AppendPlan

Large request bodies are admitted by size (``self.inflight``, a ``byte_budget.ByteBudget`` of
``--max-inflight-bytes``): the transport charges a body over ``BIG_MESSAGE_BYTES`` before it parses it.

``call`` is the ``scope.Call`` the transport entered (``call.caller``: who; ``call.headers``: the reply limit the
client declared). A method checks its arguments (``arguments``), then mutates through ``guard.mutate`` (fencing,
replay, the core and the pool under one lock, KV events) or reads under ``guard.lock``. The core raises before it
changes anything, so a failed call leaves the pool exactly as it was; a mutation whose reply might not be
deliverable is refused before it is applied (``reply_limits``).

Work too slow for the event loop is handed off (``answers.Offload``): big WriteKV/ReadKV copies run on a copy
thread in 1 MiB chunks with their sequence pinned (``kv_copies``); CheckInvariants checks a copy of the manager
taken under the lock (``invariant_checks``). The session RPCs are ``self.sessions`` (``sessions.SessionService``).

Tenants: every call passes ``call.caller.tenant_id`` to the core and the guard, which answer NOT_FOUND for another
tenant's sequence or session (None without authentication: no check).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple, cast

import numpy as np

from kvpool.layout import KVLayout
from kvpool_server.core import AppendPlan, PoolStats
from kvpool_server.core.errors import KVPoolError
from kvpool_server.core.prefix_cache import PrefixCache
from kvpool_server.device import PoolAttachInfo
from kvpool_server.device.pool import RankShard
from kvpool_server.service import arguments
from kvpool_server.service.auth import Authenticator, check_may_share_prefixes
from kvpool_server.service.byte_budget import ByteBudget
from kvpool_server.service.fair_share import FairShare
from kvpool_server.service.freeing import Freeing, free_rows
from kvpool_server.service.guard import CoreGuard
from kvpool_server.service.invariant_checks import InvariantChecks
from kvpool_server.service.kv_copies import INLINE_BYTES, SequencePins, chunk_tokens, read_chunked, write_chunked
from kvpool_server.service.kv_wire import ENVELOPE_BYTES, KVWire
from kvpool_server.service.metrics import KVPoolMetrics
from kvpool_server.offload.stats import with_tier
from kvpool_server.offload.tier_copies import TierCopies
from kvpool_server.offload.tier_pool import CopyTotals
from kvpool_server.service.answers import Offload
from kvpool_server.service.prompt_hasher import PromptHasher
from kvpool_server.service import register_batch
from kvpool_server.service.register_batch import PromptToRegister, RegisteredPrompt
from kvpool_server.service.reply_limits import ReplyLimits
from kvpool_server.service.scope import Call
from kvpool_server.service.sessions import SessionService
from kvpool_server.service.tenant_usage import TenantUsage, tenant_usage

DEFAULT_MAX_TOKENS_PER_CALL = 1 << 17
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20


NO_BLOCKS = np.zeros(0, dtype=np.int32)


class BlockTableView(NamedTuple):
    block_ids: np.ndarray
    num_tokens: int
    block_size: int
    block_hashes: list[bytes]  # one per block ("" where not cached); empty when nothing is cached


class PoolDescription(NamedTuple):
    layout: KVLayout
    num_blocks: int
    attach: PoolAttachInfo  # rank 0's shard when tensor_parallel > 1
    may_attach: bool  # False: the attach fields (shm name, IPC handle) must not be sent
    tensor_parallel: int = 1
    shards: tuple[RankShard, ...] = ()  # every rank's heads and what maps its shard


class KVPoolService:
    """The KVPoolService RPCs over one CoreGuard (see docs/api.md); ``sessions`` holds the session RPCs."""

    def __init__(self, guard: CoreGuard, sessions: SessionService, *, auth: Authenticator | None,
                 metrics: KVPoolMetrics | None, max_batch: int, max_message_bytes: int,
                 max_tokens_per_call: int = DEFAULT_MAX_TOKENS_PER_CALL,
                 max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES, tier: TierCopies | None = None) -> None:
        manager, pool = guard.manager, guard.pool
        self.tier = tier  # the host tier's copies (--host-tier-bytes), or None
        self.guard = guard
        self.sessions = sessions
        self.auth = auth
        self.metrics = metrics
        self.max_batch = max_batch
        self.wire = KVWire(pool.layout, max_message_bytes)
        self.limits = ReplyLimits(max_message_bytes, manager.num_blocks, manager.block_size,
                                  max_seq_len=manager.max_seq_len, max_tokens_per_call=max_tokens_per_call)
        self.pins = SequencePins()
        self.invariants = InvariantChecks(manager, tier.tier if tier is not None else None)
        self.chunk_tokens = chunk_tokens(pool.layout.token_bytes)
        self.inflight = ByteBudget(max(max_inflight_bytes, max_message_bytes))  # large request bodies at once
        self.fair = FairShare(guard.sessions)  # each session's recent serving time: its share (fair_share.py)
        self.hasher = PromptHasher(manager.prefix, manager.block_size, self.fair)  # long prompts, off the loop

    def reload_tokens(self) -> bool:
        """SIGHUP: re-read the tokens file (under the lock: it changes the tenants' limits)."""
        if self.auth is None:
            return False
        with self.guard.lock:
            return self.auth.reload()

    # ---------------------------------------------------------------- sequences
    def register(self, call: Call, seq_id: int | None = None, session_id: int = 0, request_id: int = 0,
                 prompt_token_ids: Sequence[int] = (), public_prefix_len: int = 0,
                 cache_extra_key: bytes = b"", prompt_hashes: list[bytes] | None = None) -> RegisteredPrompt:
        """``prompt_hashes``: the prompt's hashes from ``self.hasher`` (a job of this very prompt), else computed
        here. The answer is one of RegisterSequences' (its cached blocks go into the fast path's reply)."""
        seq_id = arguments.new_seq_id(seq_id)
        if not session_id:
            self.sessions.refuse_if_drained("RegisterSequence")
        check_may_share_prefixes(call.caller, public_prefix_len)
        tenant, manager, tier = call.caller.tenant_id, self.guard.manager, self.tier
        prompt = prompt_token_ids if len(prompt_token_ids) else None

        hashes = prompt_hashes  # the prompt's chain hashes, computed with the lock free (a bad prompt: None,
        if prompt is not None and hashes is None:  # refused under the lock, after the fencing, as the core does)
            try:
                hashes = manager.prefix.prompt_hashes(tenant, prompt, public_prefix_len, cache_extra_key)
            except (KVPoolError, IndexError):
                pass
        restoring, fenced = None, False  # the prompt's host-tier blocks, copied back unlocked, before the match
        if tier is not None and prompt is not None and hashes is not None:
            fenced = True  # in the restore's hold (its lease renewed there: once a call)
            restoring = tier.start_restore(self.guard.lock, lambda: self.guard.fence(call.caller, session_id), hashes)

        def register() -> RegisteredPrompt:
            if tier is not None:
                tier.finish_restore(restoring)  # in this hold: the match below finds the restored blocks
            new_id = manager.register(seq_id, session_id, tenant, prompt, public_prefix_len, cache_extra_key, hashes)
            if prompt is None:
                return RegisteredPrompt(new_id, 0, NO_BLOCKS)
            return register_batch.registered(manager, new_id, tenant)

        try:
            return self.guard.mutate(call.caller, session_id, request_id,
                                     ("register", seq_id, prompt_token_ids, public_prefix_len, cache_extra_key),
                                     register if tier is None else lambda: tier.call(register), renew=not fenced)
        finally:
            if restoring is not None and not restoring.finished:  # refused or replayed before apply: settle it
                with self.guard.lock:
                    tier.finish_restore(restoring)  # type: ignore[union-attr]

    def register_many(self, call: Call, prompts: Sequence[PromptToRegister], session_id: int = 0,
                      request_id: int = 0,
                      prompt_hashes: Sequence[list[bytes] | None] | None = None) -> tuple[RegisteredPrompt, ...]:
        """RegisterSequences: a sequence per prompt, all or none (register_batch.py says how). ``prompt_hashes``:
        each prompt's hashes from ``self.hasher`` (jobs of these very prompts; None where a job failed), else
        computed here."""
        register_batch.check_batch(prompts, self.max_batch, self.limits.max_tokens_per_call)
        self.limits.check_reply(register_batch.reply_bytes(prompts, self.guard.manager.block_size),
                                register_batch.RPC, call.headers, register_batch.ITEM_BYTES, "prompts")
        if not session_id:
            self.sessions.refuse_if_drained(register_batch.RPC)
        tenant, manager, tier = call.caller.tenant_id, self.guard.manager, self.tier
        checked = [register_batch.checked_input(call.caller, manager, i, p) for i, p in enumerate(prompts)]
        given = prompt_hashes if prompt_hashes is not None else [None] * len(prompts)
        hashes = [h if h is not None else register_batch.hashes_of(manager, c, p.cache_extra_key)
                  for p, c, h in zip(prompts, checked, given)]
        restoring: list = []  # each prompt's host-tier blocks, copied back unlocked, before the match
        fence = (lambda: self.guard.fence(call.caller, session_id))  # the first restore's hold renews the lease

        def apply() -> tuple[RegisteredPrompt, ...]:
            for r in restoring:
                tier.finish_restore(r)  # type: ignore[union-attr]
            ids = manager.register_many(len(prompts), session_id, tenant,
                                        prompt_token_ids=[p.prompt_token_ids for p in prompts],
                                        public_prefix_lens=[p.public_prefix_len for p in prompts],
                                        cache_extra_keys=[p.cache_extra_key for p in prompts], prompt_hashes=hashes)
            return tuple(register_batch.registered(manager, seq_id, tenant) for seq_id in ids)

        request = ("register_many", *(x for p in prompts for x in p))
        try:
            if tier is not None:
                for i, h in enumerate(hashes):
                    restoring.append(tier.start_restore(self.guard.lock, fence if i == 0 else (lambda: None), h))
            return self.guard.mutate(call.caller, session_id, request_id, request,
                                     apply if tier is None else lambda: tier.call(apply), renew=tier is None)
        finally:
            if any(r is not None and not r.finished for r in restoring):
                with self.guard.lock:
                    for r in restoring:
                        tier.finish_restore(r)  # type: ignore[union-attr]

    def append(self, call: Call, seq_ids: Sequence[int], num_tokens: Sequence[int] = (),
               token_ids: Sequence[int] = (), session_id: int = 0, request_id: int = 0) -> AppendPlan:
        """Append to a batch, atomically: every sequence grows, or none (the decode step's call)."""
        rpc = call.rpc
        ids = arguments.batch_seq_ids(seq_ids, rpc, self.max_batch)
        counts = arguments.append_counts(num_tokens, ids.size)
        token_id_list = token_ids if len(token_ids) else None  # prefix caching; None: no per-token work
        self.limits.check_append(ids.size, counts, rpc, call.headers)
        manager, pool, tenant, tier = self.guard.manager, self.guard.pool, call.caller.tenant_id, self.tier

        def apply() -> AppendPlan:
            if tier is None:
                plan = manager.append(ids, cast(Any, counts), tenant, token_id_list)
            else:  # the plan's evicted blocks go to the host tier before anything below writes into them
                plan = tier.append(lambda: manager.append(ids, cast(Any, counts), tenant, token_id_list))
            if plan.copies.shape[0]:
                pool.copy_blocks(plan.copies)
            if plan.zero_block_ids.shape[0]:  # blocks that change hands never show their old owner's bytes
                pool.zero_blocks(plan.zero_block_ids)
            return plan

        plan = self.guard.mutate(call.caller, session_id, request_id, ("append", ids, num_tokens, token_ids), apply)
        if self.metrics is not None:
            self.metrics.count_append(1)
        return plan

    def fork(self, call: Call, parent_seq_id: int, num_children: int = 0, child_seq_ids: Sequence[int] = (),
             session_id: int = 0, request_id: int = 0) -> list[int]:
        parent = arguments.seq_id(parent_seq_id, "Fork", "parent_seq_id")
        children = arguments.fork_children(num_children, child_seq_ids, self.max_batch)
        self.limits.check_reply(16 + 11 * max(num_children, len(children)), "Fork", call.headers, 11, "children")
        manager, tenant, pins = self.guard.manager, call.caller.tenant_id, self.pins

        def apply() -> list[int]:
            if len(pins):  # in this hold: a copy pins its sequence in the hold that resolved its slots
                pins.wait_unpinned((pin_key(tenant, parent),))
            return manager.fork(parent, num_children, children, session_id, tenant)

        forked = self.guard.mutate(call.caller, session_id, request_id, ("fork", parent, num_children, children),
                                   apply if self.tier is None else partial(self.tier.call, apply))
        if self.metrics is not None:
            self.metrics.count_fork(len(forked))
        return forked

    def free(self, call: Call, seq_ids: Sequence[int], session_id: int = 0, request_id: int = 0) -> int | Offload:
        """Free a batch of sequences, all or none; returns the blocks that went back to the pool. A batch whose
        blocks are too many for one lock hold is detached in one hold and released in chunks (``freeing``): an
        Offload of that."""
        ids = arguments.batch_seq_ids(seq_ids, "Free", self.max_batch).tolist()
        manager, tenant, pins = self.guard.manager, call.caller.tenant_id, self.pins

        def apply() -> int | Freeing:
            if len(pins):  # in this hold (see fork)
                pins.wait_unpinned([pin_key(tenant, seq_id) for seq_id in ids])
            freeing = free_rows(self.guard, manager.detach(ids, tenant))  # detach checks every id, changes nothing
            return freeing if isinstance(freeing, int) else freeing.start(self.guard)

        answer = self.guard.mutate(call.caller, session_id, request_id, ("free", ids),
                                   apply if self.tier is None else partial(self.tier.call, apply))
        return answer if isinstance(answer, int) else Offload(answer.wait)  # a retry waits for the same Freeing

    # ---------------------------------------------------------------- inspection
    def stats(self, call: Call) -> tuple[PoolStats, list[TenantUsage]]:
        """The pool's stats, and the tenants' usage (all for an admin, the caller's own for a frontend)."""
        manager = self.guard.manager
        with self.guard.lock:
            stats = with_tier(manager.stats(), self.tier.tier if self.tier is not None else None)
            usage = tenant_usage(manager.tenants, self.guard.sessions, None if call.caller.is_admin else
                                 call.caller.tenant_id) if manager.tenancy else []
        return stats, usage

    def tier_copies(self) -> CopyTotals | None:
        """The host tier's copy totals (bytes and seconds each way; ``TierPool.copy_totals``), None without a tier.
        Read without the guard's lock: they never wait for a copy."""
        return self.tier.memory.copy_totals() if self.tier is not None else None

    def block_table(self, call: Call, seq_id: int) -> BlockTableView:
        seq_id = arguments.seq_id(seq_id, "GetBlockTable")
        manager, tenant = self.guard.manager, call.caller.tenant_id
        with self.guard.lock:
            block_ids = manager.block_table(seq_id, tenant)
            num_tokens = manager.num_tokens(seq_id, tenant)
            hashes = block_hashes(manager.allocator.cache, block_ids)
        return BlockTableView(block_ids, num_tokens, manager.block_size, hashes)

    def describe_pool(self, call: Call) -> PoolDescription:
        """The pool's layout; with ``may_attach``, also what maps it (mapping the pool gives every byte of every
        tenant's KV: docs/security.md)."""
        pool = self.guard.pool
        shards = tuple(pool.rank_shards())
        return PoolDescription(pool.layout, pool.num_blocks, shards[0].attach, call.caller.may_attach,
                               pool.tensor_parallel, shards)

    def check_invariants(self, call: Call) -> Offload:
        return self.invariants.request(self.guard.lock)

    def drain(self, call: Call, resume: bool = False) -> tuple[int, int]:
        """The Drain RPC (maintenance, ``kvctl drain [--resume]``): see ``SessionService.drain``."""
        return self.sessions.drain(resume)

    # ---------------------------------------------------------------- KV data
    def write_kv(self, call: Call, seq_id: int, start_position: int, data: bytes | memoryview,
                 session_id: int = 0) -> int | Offload:
        """Write whole tokens' KV; returns how many tokens (or an Offload of the copy when it is big). ``data`` may
        be a view of the received body: it is read in place, never copied."""
        tokens = self.wire.decode(data)
        seq_id = arguments.seq_id(seq_id, "WriteKV")
        guard, tenant = self.guard, call.caller.tenant_id
        with guard.lock:
            guard.fence(call.caller, session_id)
            slots = guard.manager.slots(seq_id, start_position, len(tokens), for_write=True, tenant=tenant)
            if tokens.nbytes <= INLINE_BYTES:
                guard.pool.write_slots(slots, tokens)
                return len(tokens)
            pinned = pin_key(tenant, seq_id)
            self.pins.pin(pinned)  # in the hold that resolved the slots: no Free/Fork (any thread) in between

        def work() -> int:
            write_chunked(guard.pool, slots, tokens, self.chunk_tokens)
            return len(tokens)

        return Offload(work, lambda: self.pins.unpin(pinned))

    def read_kv(self, call: Call, seq_id: int, start_position: int, num_tokens: int) -> bytes | Offload:
        """Read whole tokens' KV (``num_tokens`` 0: to the end) as the wire's bytes (or an Offload when big)."""
        seq_id, start = arguments.seq_id(seq_id, "ReadKV"), start_position
        guard, tenant = self.guard, call.caller.tenant_id
        with guard.lock:
            count = num_tokens or guard.manager.num_tokens(seq_id, tenant) - start
            if num_tokens == 0 and count == 0:
                return b""  # reading to the end, from the end
            self.wire.check_read(count)
            self.limits.check_reply(ENVELOPE_BYTES + count * self.wire.token_bytes, "ReadKV", call.headers,
                                    self.wire.token_bytes, "tokens")
            slots = guard.manager.slots(seq_id, start, count, tenant=tenant)
            if count * self.wire.token_bytes <= INLINE_BYTES:
                return self.wire.encode(guard.pool.read_slots(slots))
            pinned = pin_key(tenant, seq_id)
            self.pins.pin(pinned)  # in the hold that resolved the slots (see write_kv)

        def work() -> bytes:
            out = np.empty((count, *self.wire.token_shape), dtype=guard.pool.layout.storage_dtype)
            return self.wire.encode(read_chunked(guard.pool, slots, out, self.chunk_tokens))

        return Offload(work, lambda: self.pins.unpin(pinned))


def pin_key(tenant: int | None, seq_id: int) -> int:
    """A sequence's key in ``SequencePins``: ids are per tenant (docs/security.md), so a copy on one tenant's id X
    never delays another tenant's Free of its own X."""
    return (tenant or 0) << 64 | seq_id


def block_hashes(cache: PrefixCache, block_ids: np.ndarray) -> list[bytes]:
    entries: Any = cache.entries
    if not entries:
        return []
    return [entries[b].block_hash if b in entries else b"" for b in block_ids.tolist()]
