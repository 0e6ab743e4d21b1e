"""Listings of the manager's sequences and sessions, for the service's listings and gauges: read-only, over the
manager's public state (as checks.py)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvpool_server.core.block_tables import BlockTables
from kvpool_server.core.seq_index import SequenceIndex
from kvpool_server.core.session_members import SessionMembers
from kvpool_server.core.tenant_ids import TenantIds
from kvpool_server.core.tenants import TenantLedger


class KVCacheManager(Protocol):
    """The parts of manager.KVCacheManager these listings read (a Protocol: the manager never imports this)."""

    index: SequenceIndex
    tables: BlockTables
    tenants: TenantLedger
    tenant_ids: TenantIds
    tenancy: bool
    members: SessionMembers


def named_id(manager: KVCacheManager, seq_id: int) -> int:
    """The id a live sequence's tenant names it by, from its internal id (the same without tenancy)."""
    return manager.tenant_ids.id_of_row.item(manager.index.row(seq_id)) if manager.tenancy else seq_id


def sequence_infos(manager: KVCacheManager, session_id: int | None = None,
                   tenant: int | None = None) -> list[tuple[int, int, int, int]]:
    """(seq_id, session_id, num_tokens, num_blocks) of every live sequence, or of one session's; only
    ``tenant``'s when given. The ids are the ones the sequences' tenants name them by."""
    index, tables, session_of_seq = manager.index, manager.tables, manager.members.session_of_seq
    internal = index.seq_ids() if session_id is None else manager.members.seq_ids(session_id)
    infos = []
    for seq_id in internal:
        row = index.row(seq_id)
        if tenant is None or manager.tenants.tenant_of_row.item(row) == tenant:
            named = manager.tenant_ids.id_of_row.item(row) if manager.tenancy else seq_id
            num_tokens = tables.num_tokens.item(row)
            infos.append((named, session_of_seq.get(seq_id, 0), num_tokens, tables.blocks_for(num_tokens)))
    return sorted(infos)


def session_usage(manager: KVCacheManager) -> dict[int, tuple[int, int]]:
    """session_id -> (its sequences, the distinct blocks they hold)."""
    usage = {}
    for session_id, seq_ids in manager.members.seqs_of_session.items():
        blocks = [manager.tables.blocks_of(manager.index.row(seq_id)) for seq_id in seq_ids]
        usage[session_id] = (len(seq_ids), int(np.unique(np.concatenate(blocks)).size) if blocks else 0)
    return usage
