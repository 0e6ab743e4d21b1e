"""The manager's prefix-caching operations (docs/prefix-caching.md): a register that starts from cached blocks,
and an append that carries token ids (or touches tracked sequences). Kept apart from manager.py, which calls them
only when a prompt or token ids are given or some sequence is tracked: the plain append path does no extra work."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvpool_server.core.block_hash import chain_hashes
from kvpool_server.core.errors import InvalidArgumentError
from kvpool_server.core.types import AppendPlan

if TYPE_CHECKING:
    from kvpool_server.core.manager import KVCacheManager


def reuse_prefix(manager: KVCacheManager, row: int, tenant: int, prompt: np.ndarray) -> None:
    """Start the new ``row`` with the cached full blocks of ``prompt`` (at most ``(len - 1) // block_size``:
    one token is always left to compute), within the tenant's budget for blocks revived from the LRU."""
    salt = manager.tenants.names[tenant].encode()
    usable = max(0, (prompt.size - 1) // manager.block_size) * manager.block_size
    hashes = chain_hashes(prompt[:usable], manager.block_size, salt)
    blocks = np.array(manager.allocator.cache.match(hashes), dtype=np.int32)
    if blocks.size and manager.tenancy and manager.tenants.limited:
        budget, _ = manager.tenants.budget(tenant, manager.allocator.num_allocatable)
        revived = np.cumsum(manager.allocator.ref_count[blocks] == 0)
        blocks = blocks[: int(np.searchsorted(revived, budget, side="right"))]
    revived_count = manager.tables.adopt(row, blocks) if blocks.size else 0
    if manager.tenancy:
        manager.tenants.num_blocks[tenant] += revived_count
    manager.chains.start(row, salt, hashes[: blocks.size])


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
    names = manager.tenants.names
    salts = [names[t].encode() for t in manager.tenants.tenant_of_row.take(rows).tolist()] if ids is not None else []
    manager.chains.after_append(rows, counts, lengths, ids, manager.tables.table, manager.allocator.cache, salts)
    return plan
