"""The manager's prefix-caching operations (docs/prefix-caching.md): a register that starts from cached blocks,
an append that carries token ids (or touches tracked sequences), and the tenants' accounting of public blocks on
fork and free. Kept apart from manager.py, which calls them only when a prompt or token ids are given, some
sequence is tracked, or some public block is held: the plain paths do no extra work."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvpool_server.core.block_hash import MAX_EXTRA_KEY_BYTES, chain_hashes
from kvpool_server.core.errors import InvalidArgumentError
from kvpool_server.core.types import AppendPlan

if TYPE_CHECKING:
    from kvpool_server.core.manager import KVCacheManager


def check_register_args(prompt: np.ndarray | None, public_prefix_len: int, cache_extra_key: bytes) -> None:
    """``register``'s prefix-caching arguments, before anything changes."""
    if public_prefix_len < 0:
        raise InvalidArgumentError(f"public_prefix_len must be >= 0, got {public_prefix_len}")
    if public_prefix_len > (0 if prompt is None else prompt.size):
        raise InvalidArgumentError(
            f"public_prefix_len={public_prefix_len} is longer than the prompt's {0 if prompt is None else prompt.size} "
            "tokens"
        )
    if len(cache_extra_key) > MAX_EXTRA_KEY_BYTES:
        raise InvalidArgumentError(
            f"cache_extra_key has {len(cache_extra_key)} bytes, at most {MAX_EXTRA_KEY_BYTES} are allowed"
        )


def reuse_prefix(manager: KVCacheManager, row: int, tenant: int, prompt: np.ndarray, public_prefix_len: int = 0,
                 extra: bytes = b"") -> None:
    """Start the new ``row`` with the cached full blocks of ``prompt`` (at most ``(len - 1) // block_size``:
    one token is always left to compute), within the tenant's budget for blocks new to it: revived from the LRU,
    or public blocks that only other tenants hold. Its first ``public_prefix_len // block_size`` blocks are
    public (hashed with PUBLIC_SALT)."""
    salt = manager.tenants.names[tenant].encode()
    bs, allocator, ledger = manager.block_size, manager.allocator, manager.tenants
    num_public = public_prefix_len // bs
    usable = max(0, (prompt.size - 1) // bs) * bs
    hashes = chain_hashes(prompt[:usable], bs, salt, extra=extra, num_public=num_public)
    blocks = np.array(allocator.cache.match(hashes), dtype=np.int32)
    public = allocator.cache.is_public[blocks] if manager.tenancy and allocator.cache.num_public else None
    if blocks.size and manager.tenancy and ledger.limited:
        budget, _ = ledger.budget(tenant, allocator.num_allocatable)
        revived = allocator.ref_count[blocks] == 0  # take allocatable blocks: bounded by quota and reservations
        new = revived if public is None else revived | (public & _unheld(ledger.public_refs, tenant, blocks))
        blocks = blocks[: min(int(np.searchsorted(np.cumsum(revived), budget, side="right")),
                              int(np.searchsorted(np.cumsum(new), ledger.quota_left(tenant), side="right")))]
    if blocks.size:
        newly_held = int(np.count_nonzero(allocator.ref_count[blocks] == 0)) if manager.tenancy else 0
        if public is not None:
            public = public[: blocks.size]
            newly_held -= int(np.count_nonzero(allocator.ref_count[blocks[public]] == 0))  # counted below
            newly_held += ledger.adopt_public(tenant, blocks[public].tolist())
        manager.tables.adopt(row, blocks)
        ledger.num_blocks[tenant] += newly_held
    manager.chains.start(row, salt, hashes[: blocks.size], extra, num_public)


def _unheld(public_refs: dict[tuple[int, int], int], tenant: int, blocks: np.ndarray) -> np.ndarray:
    """Which of ``blocks`` no row of ``tenant`` references through ``public_refs``."""
    return np.array([(tenant, b) not in public_refs for b in blocks.tolist()], dtype=bool)


def append_tracked(
    manager: KVCacheManager, seq_ids: int | Sequence[int] | np.ndarray, num_new_tokens: int | Sequence[int],
    tenant: int | None, token_ids: Sequence[int] | np.ndarray | None,
) -> AppendPlan:
    """``KVCacheManager.append`` when token ids are given or some rows are tracked (``TokenChains.after_append``)."""
    plain_rows = manager._rows(seq_ids)  # an int for one sequence, as the plain path has it
    rows = np.atleast_1d(np.asarray(plain_rows, dtype=np.intp))
    plain_counts = manager._counts(num_new_tokens, rows.size)
    counts = np.broadcast_to(np.asarray(plain_counts, dtype=np.int64), rows.shape)
    ids = None
    if token_ids is not None:
        ids = np.asarray(token_ids, dtype=np.uint32)
        if ids.shape != (int(counts.sum()),):
            raise InvalidArgumentError(f"{ids.size} token_ids for {int(counts.sum())} appended tokens")
    lengths = manager.tables.num_tokens.take(rows)
    if manager.tenancy:
        plan = manager._append_as(seq_ids, plain_rows, plain_counts, tenant)
    else:
        plan = manager.tables.plan_append(plain_rows, plain_counts)
    ledger = manager.tenants
    salts = [ledger.names[t].encode() for t in ledger.tenant_of_row.take(rows).tolist()] if ids is not None else []
    sealed_public = manager.chains.after_append(rows, counts, lengths, ids, manager.tables.table,
                                                manager.allocator.cache, salts)
    if manager.tenancy:
        for row, block_id in sealed_public:
            ledger.seal_public(ledger.tenant_of_row.item(row), block_id, manager.allocator.ref_count.item(block_id))
    return plan


def fork_public(manager: KVCacheManager, parent_row: int, num_children: int, tenant: int) -> None:
    """A fork's children reference the parent's public blocks too (with tenancy, while some block is public)."""
    blocks = manager.tables.table[parent_row, : manager.tables.blocks_for(manager.tables.num_tokens.item(parent_row))]
    public = blocks[manager.allocator.cache.is_public[blocks]]
    if public.size:
        manager.tenants.adopt_public(tenant, public.tolist(), num_children)


def held_public(manager: KVCacheManager, rows: list[int]) -> list[int]:
    """The public blocks ``rows`` reference, one entry per reference (call before releasing them)."""
    tables, is_public = manager.tables, manager.allocator.cache.is_public
    held = []
    for row in rows:
        blocks = tables.table[row, : tables.blocks_for(tables.num_tokens.item(row))]
        held += blocks[is_public[blocks]].tolist()
    return held


def released_blocks(manager: KVCacheManager, tenant: int, public: list[int], num_freed: int) -> int:
    """How many blocks ``tenant`` no longer holds after its rows that referenced ``public`` (``held_public``) were
    released, freeing ``num_freed`` blocks: the freed private ones, and the public ones it has no row left on (a
    freed public block is among those)."""
    if not public:
        return num_freed
    unique = np.unique(np.array(public, dtype=np.int32))
    freed_public = int(np.count_nonzero(manager.allocator.ref_count[unique] == 0))
    return num_freed - freed_public + manager.tenants.release_public(tenant, public)
