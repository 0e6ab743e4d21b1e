"""The tenants' side of the block tables: an append planned within its tenant's budget, and rows released with
each tenant credited what it no longer holds (docs/security.md). Plain arguments: the tables and the ledger
(``TenantLedger``, whose docstring holds the invariants); the manager calls these with tenancy on."""

from __future__ import annotations

import numpy as np

from kvpool_server.core.block_tables import BlockTables
from kvpool_server.core.seq_index import not_live
from kvpool_server.core.tenants import TenantLedger
from kvpool_server.core.types import AppendPlan


def plan_within_budget(tables: BlockTables, ledger: TenantLedger, seq_ids: object, rows: int | np.ndarray,
                       num_new_tokens: int | np.ndarray, tenant: int | None) -> AppendPlan:
    """The plan with tenancy on: the blocks it may take are bounded by the tenant's budget
    (``TenantLedger.budget``), passed to the tables; the tenant is charged the blocks taken. The rows of a
    tenant's call were resolved in its namespace; those of a trusted call (``tenant=None``) must be one tenant's
    (one gather, one compare)."""
    if tenant is None:
        owners = ledger.tenant_of_row.take(rows)
        tenant = int(owners if rows.__class__ is int else owners.item(0))
        if np.count_nonzero(owners != tenant):
            ids = np.atleast_1d(np.asarray(seq_ids, dtype=np.uint64))
            raise not_live(int(ids[np.atleast_1d(owners) != tenant][0]))
    if ledger.limited:
        budget, why = ledger.budget(tenant, tables.allocator.num_allocatable)
        plan = tables.plan_append(rows, num_new_tokens, budget, why)
    else:
        plan = tables.plan_append(rows, num_new_tokens)
    ledger.num_blocks[tenant] += plan.new_block_ids.size
    return plan


def release_rows(tables: BlockTables, ledger: TenantLedger, tenancy: bool, rows: list[int]) -> int:
    """Drop the blocks of ``rows`` (distinct), each tenant's rows apart, crediting (with ``tenancy``) each tenant
    what it no longer holds, and take the rows off the ledger. Returns the blocks freed."""
    owners = ledger.tenant_of_row[rows].tolist()
    num_freed, distinct = 0, sorted(set(owners))
    for owner in distinct:  # each tenant's rows apart: the ledger credits what it no longer holds
        group = rows if len(distinct) == 1 else [row for row, o in zip(rows, owners) if o == owner]
        public = _public_held(tables, group) if tenancy and ledger.public_refs else []
        freed = tables.release(group)
        if tenancy:
            ledger.credit_released(owner, freed, public, tables.allocator.ref_count)
        num_freed += freed
    ledger.remove_rows(rows)
    return num_freed


def _public_held(tables: BlockTables, rows: list[int]) -> list[int]:
    """The public blocks ``rows`` reference, one entry per reference (read before releasing them)."""
    is_public = tables.allocator.cache.is_public
    held: list[int] = []
    for row in rows:
        blocks = tables.blocks_of(row)
        held += blocks[is_public[blocks]].tolist()
    return held
