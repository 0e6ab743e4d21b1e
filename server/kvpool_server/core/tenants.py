"""TenantLedger: which tenant each sequence row belongs to, what each tenant holds, and each tenant's limits.

A tenant is a name (from the server's tokens file) mapped to a small int, ``tenant_id``; tenant 0 ("") is the
default, which owns every sequence while authentication is off. The manager keeps one ``tenant_of_row`` entry per
sequence row beside its block-table row, so that a batch of 256 ids is checked with one gather and one compare::

    rows          [ 3 | 9 | 4 ]        tenant_of_row.take(rows) == [1 1 1] == caller's tenant 1 ?  yes: serve
    tenant_of_row [0 0 0 1 1 0 0 0 0 1 ...]                                                       no: NOT_FOUND

A tenant holds a block while some row of it references the block, and is charged for each block it holds once
(``num_blocks``), like a shared page in each process's RSS. Most blocks are held by one tenant only: a fork's
children belong to their parent's tenant, only a sequence of the caller's tenant can be forked, and a prefix match
with the tenant's own salt finds only its own blocks. So these need no per-block owner: a block is charged to the
tenant whose append allocated it (a copy-on-write copy to the tenant whose append made it) or revived it from the
evictable LRU, and credited back when its last reference goes.

The exception is a public prefix (docs/prefix-caching.md): a sealed block hashed with PUBLIC_SALT
(``PrefixCache.is_public``) may be adopted by rows of any tenant allowed to share prefixes. For those blocks only,
``public_refs[(tenant, block)]`` counts the tenant's rows that reference the block: a tenant is charged when its
count goes 0 -> 1 (a register that adopts it) and credited when it goes back to 0 (a free), whatever other
tenants hold. A sealed block is full, so copy-on-write never touches it; its references change only in register,
fork (children of the same tenant) and free, and the append path never looks at ``public_refs``.

::

    block 7 (public)   rows of tenant a: 3, 5   rows of tenant b: 9     public_refs {(a, 7): 2, (b, 7): 1}
                       ref_count[7] = 3                                  num_blocks[a] and [b] each count block 7

Invariants (``checks.check_tenants``): a free row's ``tenant_of_row`` is 0 and a live row's names a known tenant;
``num_sequences[t]`` is the number of live rows of tenant t; and, kept and checked only with the manager's
``tenancy`` on (off, tenant 0 holds every used block, and a benchmark may plan on the tables directly):
``num_blocks[t]`` is the number of distinct blocks referenced by rows of tenant t; only sealed public blocks may
be referenced by rows of two tenants; ``public_refs`` holds exactly the (tenant, public block) pairs with a
reference, each with the number of the tenant's rows that reference the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpool_server.core.errors import InvalidArgumentError, QuotaExceededError
from kvpool_server.core.types import UNLIMITED

DEFAULT_TENANT = 0


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's quotas (None: no limit) and its guaranteed reservation (blocks no other tenant may take)."""

    max_blocks: int | None = None
    max_sequences: int | None = None
    max_sessions: int | None = None
    reserved_blocks: int = 0


class TenantLedger:
    def __init__(self, max_rows: int) -> None:
        self.names: list[str] = [""]  # tenant_id -> name
        self.ids: dict[str, int] = {"": DEFAULT_TENANT}
        self.limits: list[TenantLimits] = [TenantLimits()]
        self.num_blocks: list[int] = [0]  # tenant_id -> distinct blocks its sequences hold
        self.num_sequences: list[int] = [0]  # tenant_id -> its live sequences
        self.tenant_of_row: np.ndarray = np.zeros(max_rows, dtype=np.int32)
        self.limited: bool = False  # whether any tenant has a block quota or a reservation (appends then budget)
        self.public_refs: dict[tuple[int, int], int] = {}  # (tenant, public block) -> the tenant's rows holding it

    def tenant_id(self, name: str) -> int:
        """The id of tenant ``name``, made on first use."""
        tenant = self.ids.get(name)
        if tenant is None:
            tenant = self.ids[name] = len(self.names)
            self.names.append(name)
            self.limits.append(TenantLimits())
            self.num_blocks.append(0)
            self.num_sequences.append(0)
        return tenant

    def set_limits(self, tenant: int, limits: TenantLimits) -> None:
        self.limits[tenant] = limits
        self.limited = any(lim.max_blocks is not None or lim.reserved_blocks for lim in self.limits)

    def budget(self, tenant: int, num_free_blocks: int) -> tuple[int, str]:
        """How many blocks ``tenant`` may still take, and the quota that bounds it (for the error message): its
        ``max_blocks`` less what it holds, and the free blocks less what other tenants have reserved and not used."""
        limits, held = self.limits[tenant], self.num_blocks[tenant]
        budget, why = UNLIMITED, ""
        if limits.max_blocks is not None:
            budget = limits.max_blocks - held
            why = f"tenant {self.names[tenant]!r} quota max_blocks={limits.max_blocks} ({held} held)"
        reserved = sum(max(0, lim.reserved_blocks - used) for t, (lim, used) in
                       enumerate(zip(self.limits, self.num_blocks)) if t != tenant)
        if reserved and num_free_blocks - reserved < budget:
            budget = max(0, num_free_blocks - reserved)
            why = f"{reserved} free blocks are reserved for other tenants (their reserved_blocks)"
        return budget, why

    def quota_left(self, tenant: int) -> int:
        """How many more blocks ``tenant`` may hold under its ``max_blocks`` (reservations aside)."""
        limit = self.limits[tenant].max_blocks
        return UNLIMITED if limit is None else limit - self.num_blocks[tenant]

    # ------------------------------------------------ public blocks: references per (tenant, block)
    def seal_public(self, tenant: int, block_id: int, num_refs: int) -> None:
        """A block ``tenant``'s rows hold (``num_refs`` of them: only one tenant can hold an unsealed block) was
        sealed as public: count its references from here on (the tenant holds it already)."""
        self.public_refs[(tenant, block_id)] = num_refs

    def adopt_public(self, tenant: int, block_ids: list[int], times: int = 1) -> int:
        """``times`` more rows of ``tenant`` reference each public block (a register, or a fork's children).
        Returns how many of them the tenant did not hold before (the caller charges them)."""
        newly_held, refs = 0, self.public_refs
        for block_id in block_ids:
            key = (tenant, block_id)
            before = refs.get(key, 0)
            refs[key] = before + times
            newly_held += before == 0
        return newly_held

    def adoptable(self, tenant: int, blocks: np.ndarray, revived: np.ndarray, public: np.ndarray | None,
                  num_allocatable: int) -> int:
        """How many of a prefix match's leading ``blocks`` ``tenant`` may adopt: those ``revived`` (ref count 0: they
        take allocatable blocks) within its ``budget``, and those new to it (revived, or ``public`` ones no row of
        it holds) within its ``max_blocks``."""
        budget, _ = self.budget(tenant, num_allocatable)
        new = revived if public is None else revived | (public & self._unheld(tenant, blocks))
        return min(int(np.searchsorted(np.cumsum(revived), budget, side="right")),
                   int(np.searchsorted(np.cumsum(new), self.quota_left(tenant), side="right")))

    def charge_adopted(self, tenant: int, blocks: np.ndarray, revived: np.ndarray, public: np.ndarray | None) -> None:
        """A row of ``tenant`` adopts ``blocks`` (a prefix match; ``revived``: those of ref count 0, ``public``:
        those public, or None while no block is public): charge the revived private ones and the public ones it
        did not hold."""
        newly_held = int(np.count_nonzero(revived))
        if public is not None:
            newly_held -= int(np.count_nonzero(revived & public))  # counted by adopt_public
            newly_held += self.adopt_public(tenant, blocks[public].tolist())
        self.num_blocks[tenant] += newly_held

    def _unheld(self, tenant: int, blocks: np.ndarray) -> np.ndarray:
        """Which of ``blocks`` no row of ``tenant`` references through ``public_refs``."""
        return np.array([(tenant, b) not in self.public_refs for b in blocks.tolist()], dtype=bool)

    def credit_released(self, tenant: int, num_freed: int, public: list[int], ref_count: np.ndarray) -> None:
        """Rows of ``tenant`` that referenced the public blocks ``public`` (one entry per reference) were released,
        freeing ``num_freed`` blocks (``ref_count``: the counts after): credit the freed private blocks and the
        public ones it has no row left on (a freed public block is among those)."""
        released = num_freed
        if public:
            unique = np.unique(np.array(public, dtype=np.int32))
            released += self.release_public(tenant, public) - int(np.count_nonzero(ref_count[unique] == 0))
        self.num_blocks[tenant] -= released

    def release_public(self, tenant: int, block_ids: list[int]) -> int:
        """One reference of a row of ``tenant`` per entry of ``block_ids`` (may repeat) is gone (a free). Returns
        how many blocks the tenant no longer holds (the caller credits them)."""
        released, refs = 0, self.public_refs
        for block_id in block_ids:
            key = (tenant, block_id)
            left = refs[key] - 1
            if left:
                refs[key] = left
            else:
                del refs[key]
                released += 1
        return released

    def check_new_sequences(self, tenant: int, num: int) -> None:
        limit = self.limits[tenant].max_sequences
        if limit is not None and self.num_sequences[tenant] + num > limit:
            raise QuotaExceededError(
                f"tenant {self.names[tenant]!r} quota max_sequences={limit} ({self.num_sequences[tenant]} live, "
                f"{num} more asked)"
            )

    def add_rows(self, rows: list[int] | np.ndarray, tenant: int) -> None:
        if not 0 <= tenant < len(self.names):
            raise InvalidArgumentError(f"tenant {tenant} is not known")
        if len(rows) == 1:  # a register's one row: a scalar store (a list index costs ~1.5 us, most of a register)
            self.tenant_of_row[rows[0]] = tenant
        else:
            self.tenant_of_row[rows] = tenant
        self.num_sequences[tenant] += len(rows)

    def remove_rows(self, rows: list[int]) -> None:
        for row in rows:
            self.num_sequences[self.tenant_of_row.item(row)] -= 1
        self.tenant_of_row[rows] = DEFAULT_TENANT
