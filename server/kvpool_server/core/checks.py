"""Inspection of the manager and its block tables: the invariant checks and the statistics. Slow, thorough,
read-only."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvpool_server.core.allocator import BlockAllocator
from kvpool_server.core.block_tables import UNSET, BlockTables
from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.core.prefix_reuse import PrefixReuse
from kvpool_server.core.seq_index import SequenceIndex
from kvpool_server.core.session_members import SessionMembers
from kvpool_server.core.tenant_ids import TenantIds
from kvpool_server.core.tenants import TenantLedger
from kvpool_server.core.token_chains import TokenChains
from kvpool_server.core.types import PoolStats


class KVCacheManager(Protocol):
    """The parts of manager.KVCacheManager these checks read (a Protocol: the manager calls down into this module,
    never the other way)."""

    block_size: int
    index: SequenceIndex
    tables: BlockTables
    allocator: BlockAllocator
    tenants: TenantLedger
    tenant_ids: TenantIds
    chains: TokenChains
    tenancy: bool
    members: SessionMembers
    detached_rows: set[int]
    held_outside: dict[int, np.ndarray]
    prefix: PrefixReuse


def check_invariants(manager: KVCacheManager) -> None:
    """Raise InvariantViolationError naming the first broken invariant of the manager, its index, its tables or
    their allocator (each written in the docstring of the class that keeps it)."""
    manager.index.check_invariants()
    check_block_tables(manager.tables, list(manager.held_outside.values()))
    live = manager.index.live_rows()
    detached = np.array(sorted(manager.detached_rows), dtype=live.dtype)
    indexed = np.sort(np.concatenate([live, detached]))
    in_use = manager.tables.rows_in_use()
    if not np.array_equal(indexed, in_use) or np.intersect1d(live, detached).size:
        raise InvariantViolationError(
            f"the index names rows {np.setxor1d(indexed, in_use)[:8].tolist()} differently from the tables "
            "(a row is in use iff a live sequence holds it or it is detached, not both)"
        )
    manager.members.check_invariants(manager.index)
    check_tenants(manager)
    if manager.tenancy:
        manager.tenant_ids.check_invariants(live, manager.tenants.tenant_of_row)  # detached rows are unnamed
    check_chains(manager)


def check_chains(manager: KVCacheManager) -> None:
    """TokenChains' invariants (its class docstring), against the tables."""
    manager.chains.check_invariants(manager.tables.num_tokens, manager.tables.rows_in_use())


def check_tenants(manager: KVCacheManager) -> None:
    """The TenantLedger's invariants (see its module docstring)."""
    ledger, tables = manager.tenants, manager.tables
    rows = tables.rows_in_use()
    owners = ledger.tenant_of_row[rows]
    if np.count_nonzero(np.delete(ledger.tenant_of_row, rows)):
        raise InvariantViolationError("a free sequence row still names a tenant")
    if owners.size and not 0 <= owners.min() <= owners.max() < len(ledger.names):
        raise InvariantViolationError("a live sequence row names an unknown tenant")
    counted = np.bincount(owners, minlength=len(ledger.names)).tolist()
    if counted != ledger.num_sequences:
        raise InvariantViolationError(f"tenants' sequence counts {ledger.num_sequences} differ from {counted}")
    if not manager.tenancy:
        return  # every sequence is tenant 0's, and blocks are not counted per tenant
    lengths = tables.num_tokens[rows]
    held = np.arange(tables.max_blocks_per_seq) < tables.blocks_for(lengths)[:, None]
    refs = np.stack([np.repeat(owners, held.sum(axis=1)), tables.table[rows][held]], axis=1)  # (tenant, block) each
    pairs, num_rows = np.unique(refs, axis=0, return_counts=True)
    block_ids, num_tenants = np.unique(pairs[:, 1], return_counts=True)
    is_public = manager.allocator.cache.is_public
    if not is_public[block_ids[num_tenants > 1]].all():
        raise InvariantViolationError("a block that is not a sealed public block is held by sequences of two tenants")
    blocks = np.bincount(pairs[:, 0], minlength=len(ledger.names)).tolist()
    if blocks != ledger.num_blocks:
        raise InvariantViolationError(f"tenants' block counts {ledger.num_blocks} differ from the tables' {blocks}")
    public = is_public[pairs[:, 1]]
    counted_refs = {(t, b): n for (t, b), n in zip(pairs[public].tolist(), num_rows[public].tolist())}
    if counted_refs != ledger.public_refs:
        raise InvariantViolationError("the ledger's public_refs differ from the rows that reference public blocks")


def check_block_tables(tables: BlockTables, held_elsewhere: list[np.ndarray] | None = None) -> None:
    """Raise InvariantViolationError naming the first broken invariant of the tables or their allocator (see the
    BlockTables docstring). ``held_elsewhere``: references no table holds (the host tier's restores in flight)."""
    tables.allocator.check_invariants()
    free, bs = tables.free_rows(), tables.block_size
    if len(set(free)) != len(free):
        raise InvariantViolationError("a row is on the free list twice")
    if free and (tables.num_tokens[free].any() or tables.next_slot[free].any() or (tables.table[free] != UNSET).any()):
        raise InvariantViolationError("a free row still holds tokens, a next slot or blocks")
    rows = tables.rows_in_use()
    lengths = tables.num_tokens[rows]
    if (lengths < 0).any() or (lengths > tables.max_seq_len).any():
        raise InvariantViolationError("a sequence length is negative or over max_seq_len")
    width = np.arange(tables.max_blocks_per_seq)
    held = width < tables.blocks_for(lengths)[:, None]  # [rows, max_blocks_per_seq]: the entries each row holds
    sub = tables.table[rows]
    if (sub[held] < 0).any() or (sub[held] >= tables.allocator.num_blocks).any():
        raise InvariantViolationError("a live sequence holds an invalid block id")
    if (sub[~held] != UNSET).any():
        raise InvariantViolationError("a block table has entries past its last block")
    for row, blocks in zip(rows.tolist(), sub):
        if np.unique(blocks[blocks != UNSET]).size != np.count_nonzero(blocks != UNSET):  # held entries only
            raise InvariantViolationError(f"row {row} holds a block twice")
    partial = lengths % bs != 0
    expected_next = tables.slots(rows[partial], lengths[partial])
    if not np.array_equal(tables.next_slot[rows[partial]], expected_next):
        bad = rows[partial][tables.next_slot[rows[partial]] != expected_next][:8]
        raise InvariantViolationError(f"next_slot disagrees with the block table at rows {bad.tolist()}")
    counted, stored = np.bincount(sub[held], minlength=tables.allocator.num_blocks), tables.allocator.ref_count
    for chain in held_elsewhere or []:
        counted += np.bincount(chain, minlength=tables.allocator.num_blocks)
    if not np.array_equal(counted, stored):
        bad = np.flatnonzero(counted != stored)[:8]
        raise InvariantViolationError(
            f"ref counts differ from block-table references at blocks {bad.tolist()}: "
            f"counted {counted[bad].tolist()}, stored {stored[bad].tolist()}"
        )
    fills = np.clip(lengths[:, None] - width * bs, 0, bs)[held]  # tokens each held block holds, per row
    order = np.argsort(sub[held], kind="stable")
    block_ids, fills = sub[held][order], fills[order]
    if (fills[1:] != fills[:-1])[block_ids[1:] == block_ids[:-1]].any():
        raise InvariantViolationError("sequences sharing a block disagree on how many tokens it holds")
    if tables.num_copies < 0:
        raise InvariantViolationError(f"negative copy count {tables.num_copies}")
    if tables.num_tokens_appended < 0:
        raise InvariantViolationError(f"negative appended-token count {tables.num_tokens_appended}")


def stats(manager: KVCacheManager) -> PoolStats:
    """A snapshot of the pool's occupancy (see PoolStats)."""
    tables, allocator, bs = manager.tables, manager.allocator, manager.block_size
    rows = manager.index.live_rows()
    lengths = tables.num_tokens[rows]
    partial = lengths % bs != 0
    last_blocks = tables.table[rows[partial], tables.blocks_for(lengths[partial]) - 1]
    _, first = np.unique(last_blocks, return_index=True)  # a shared block's unused slots count once
    return PoolStats(
        num_blocks_total=allocator.num_blocks,
        num_blocks_free=allocator.num_free_blocks,
        num_blocks_used=allocator.num_used_blocks,
        num_blocks_shared=int(np.count_nonzero(allocator.ref_count > 1)),
        num_tokens=int(lengths.sum()),
        num_slots_unused=int((bs - lengths[partial][first] % bs).sum()),
        num_copies=tables.num_copies,
        num_sequences=len(manager.index),
        block_size=bs,
        num_blocks_evictable=allocator.cache.num_evictable,
        prefix_query_tokens=manager.prefix.query_tokens,
        prefix_hit_tokens=manager.prefix.hit_tokens,
        num_tokens_appended=tables.num_tokens_appended,
        num_blocks_evicted=allocator.cache.num_evicted,
    )

