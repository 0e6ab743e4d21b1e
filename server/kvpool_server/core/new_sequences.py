"""New sequences' arguments checked before anything changes: one register's prompt, and a burst of registers
(``KVCacheManager.register_many``) refused exactly where N single registers would refuse one -- with that
register's status -- but before any of them is applied. Reads the ledger and the tables; changes nothing.

A burst of N registers, in order, refuses at the first register i that one of these refuses (for one i, in this
order, as ``register`` checks them): i's prompt arguments (``check_register_args``); the tenant's
``max_sequences`` with i registered before it; i's caller-chosen id, taken (by a live sequence, or by an earlier
register of the burst: ALREADY_EXISTS) or out of range; ``max_num_seqs`` with i registered before it. Only the
first two kinds need a pass over the burst (prompts, caller ids); the counts are two subtractions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvpool_server.core.block_tables import BlockTables
from kvpool_server.core.call_args import check_register_args
from kvpool_server.core.errors import InvalidArgumentError, OutOfBlocksError, SequenceExistsError
from kvpool_server.core.seq_index import check_caller_seq_id
from kvpool_server.core.tenants import TenantLedger

PromptInput = Sequence[int] | np.ndarray | None


def prompt_of(prompt_token_ids: PromptInput, public_prefix_len: int, cache_extra_key: bytes,
              max_seq_len: int) -> np.ndarray | None:
    """A register's prompt as uint32, checked (``check_register_args``); None: untracked. A ``cache_extra_key``
    without a prompt tracks the sequence from its first append, with the key (an empty prompt)."""
    prompt = None if prompt_token_ids is None else np.asarray(prompt_token_ids, dtype=np.uint32)
    check_register_args(prompt, public_prefix_len, cache_extra_key, max_seq_len)
    if prompt is None and cache_extra_key:
        return np.zeros(0, dtype=np.uint32)
    return prompt


def per_register(values: Sequence | None, num: int, name: str) -> Sequence | None:
    """A burst's per-register argument: None, or exactly one value per register (INVALID_ARGUMENT otherwise)."""
    if values is not None and len(values) != num:
        raise InvalidArgumentError(f"{len(values)} {name} for {num} new sequences")
    return values


def check_burst(num: int, tenant: int, ledger: TenantLedger, tables: BlockTables, max_seq_len: int,
                seq_ids: Sequence[int] | None, id_taken: Callable[[int], bool],
                prompts: Sequence[PromptInput] | None, public_prefix_lens: Sequence[int] | None,
                cache_extra_keys: Sequence[bytes] | None) -> list[np.ndarray | None]:
    """Raise the refusal of the first of ``num`` registers (module docstring) that N single registers would refuse;
    else return each register's prompt (``prompt_of``). ``id_taken``: whether a caller-chosen id is held already
    (in the tenant's namespace, with tenancy on)."""
    limit = ledger.limits[tenant].max_sequences
    quota_at = num if limit is None else max(0, limit - ledger.num_sequences[tenant])  # the first it refuses
    rows_at = max(0, tables.max_num_seqs - tables.num_live_rows())
    stop = min(num, quota_at, rows_at)  # registers before it pass the counts
    converted: list[np.ndarray | None] = [None] * num
    with_args = prompts is not None or public_prefix_lens is not None or cache_extra_keys is not None
    if with_args or seq_ids is not None:
        chosen: set[int] = set()
        for i in range(min(num, stop + 1)):
            if with_args:
                converted[i] = prompt_of(None if prompts is None else prompts[i],
                                         0 if public_prefix_lens is None else public_prefix_lens[i],
                                         b"" if cache_extra_keys is None else cache_extra_keys[i], max_seq_len)
            if i == quota_at:
                break
            if seq_ids is not None:
                seq_id = seq_ids[i]
                if seq_id in chosen or id_taken(seq_id):
                    raise SequenceExistsError(f"sequence {seq_id} already exists")
                chosen.add(check_caller_seq_id(seq_id))
    if stop < num:
        if stop == quota_at:
            ledger.check_new_sequences(tenant, num)  # raises: QUOTA (RESOURCE_EXHAUSTED)
        raise OutOfBlocksError(f"{num} more sequences would exceed max_num_seqs={tables.max_num_seqs} "
                               f"({tables.num_live_rows()} are live)")
    return converted
