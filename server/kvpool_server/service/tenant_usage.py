"""TenantUsage: one tenant's usage and quotas, as Stats answers them (with --auth-tokens)."""

from __future__ import annotations

from typing import NamedTuple

from kvpool_server.core.sessions import SessionTable
from kvpool_server.core.tenants import TenantLedger


class TenantUsage(NamedTuple):
    tenant: str
    num_sequences: int
    num_blocks: int
    num_sessions: int
    max_blocks: int | None  # None: no limit; 0: none allowed (the tokens file's own meaning)
    max_sequences: int | None
    max_sessions: int | None
    reserved_blocks: int


def tenant_usage(ledger: TenantLedger, sessions: SessionTable, tenant: int | None) -> list[TenantUsage]:
    """Every tenant's usage and quotas (``tenant`` None), or one tenant's."""
    ids = range(1, len(ledger.names)) if tenant is None else [tenant]
    usage = []
    for t in ids:
        lim = ledger.limits[t]
        usage.append(TenantUsage(
            ledger.names[t], ledger.num_sequences[t], ledger.num_blocks[t], sessions.num_sessions(t),
            lim.max_blocks, lim.max_sequences, lim.max_sessions, lim.reserved_blocks,
        ))
    return usage
