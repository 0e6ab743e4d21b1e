"""A prompt's blocks found in the host tier brought back into the pool: ``stage`` plans, ``finish`` settles.

    staged = stage(tier, hashes)     # a load plan: fresh pool blocks, the pairs (host slot, pool block), and the
                                     # stores its own allocation's evictions need (``staged.stores``)
    ... the driver runs ``staged.stores``, then the loads (``staged.pairs``) ...
    finish(tier, staged, ok)         # ok: the blocks enter the prefix cache; else they go, fenced

Between the two, the restored blocks are held (ref count 1) by nobody's table and are not in the prefix cache: no
match can reach them before their bytes are there, and no other sequence can read them. The driver copies with the
lock released (other calls run meanwhile); the manager's ``held_outside`` holds the staging's references and
``HostTier.restoring`` its pinned slots until ``finish``, which drops them, so a register's plain prefix match
(``PrefixReuse.start``) right after, in the same lock hold, adopts them like any cached block -- the register path
itself is unchanged, and a failed restore leaves exactly a miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvpool_server.core.kv_event_types import CachedBlock
from kvpool_server.offload.host_tier import HostTier, StorePlan


class StagedRestore(NamedTuple):
    key: int  # its entry in ``HostTier.restoring`` until ``finish``
    pairs: np.ndarray  # int32 [n, 2]: (host slot, fresh pool block), the copies to run
    entries: list[CachedBlock]  # the content of each restored block, in ``pairs`` order
    chain: np.ndarray  # int32: every pool block of the matched run, in chain order (held ones and fresh ones)
    stores: StorePlan  # what the staging's own allocation evicted: stored before the loads write the fresh blocks


def stage(tier: HostTier, hashes: list[bytes]) -> StagedRestore | None:
    """Walk ``hashes`` (a prompt's chain) while each is in the pool's cache or committed in the tier; for the
    tier's, take fresh pool blocks (as many as can be allocated) and pin their slots. The pool's blocks of the run
    get one more reference, so that the staging's own allocation (which may evict: ``stores``) cannot take them.
    None when the run holds no tier block (nothing to restore, nothing taken)."""
    allocator = tier.manager.allocator
    cache = allocator.cache
    in_pool, in_tier = cache.block_of_hash, tier.slot_of_hash
    walk: list[tuple[bool, int]] = []  # (from the tier, pool block or host slot)
    num_idle = 0  # pool blocks of the run nobody holds: holding them takes them off the allocatable count
    budget = allocator.num_allocatable
    num_host = 0
    for h in hashes:
        block_id = in_pool.get(h)
        if block_id is not None:
            num_idle += allocator.ref_count.item(block_id) == 0
            walk.append((False, block_id))
            continue
        slot = in_tier.get(h)
        if slot is None or slot in tier.pinned or num_host + 1 > budget - num_idle:
            break  # a pinned slot: another restore is copying it (not done yet): a miss from here
        walk.append((True, slot))
        num_host += 1
    while walk and not walk[-1][0]:  # the run's tail of pool blocks: a plain match finds them anyway
        walk.pop()
    if not num_host:
        return None
    held = np.array([i for from_tier, i in walk if not from_tier], dtype=np.int32)
    slots = [i for from_tier, i in walk if from_tier]
    if held.size:
        allocator.reuse(held)
    tier.pin(slots)
    fresh = allocator.allocate(len(slots))  # may evict: its stores never take a pinned slot (off the LRU)
    stores = tier.prepare_store(cache.take_evicted())
    chain = np.empty(len(walk), dtype=np.int32)
    is_fresh = np.array([from_tier for from_tier, _ in walk], dtype=bool)
    chain[is_fresh] = fresh
    chain[~is_fresh] = held
    pairs = np.stack([np.array(slots, dtype=np.int32), fresh.astype(np.int32)], axis=1)
    key = tier.next_restore_key
    tier.next_restore_key += 1
    tier.restoring[key] = slots
    tier.manager.held_outside[key] = chain
    return StagedRestore(key, pairs, [tier.entries[s] for s in slots], chain, stores)


def stage_prompt(tier: HostTier, tenant: int | None, prompt_token_ids: Sequence[int] | np.ndarray,
                 public_prefix_len: int = 0, cache_extra_key: bytes = b"",
                 hashes: list[bytes] | None = None) -> StagedRestore | None:
    """``stage`` of a register's prompt (``hashes``: its ``prefix.prompt_hashes``, else computed here, checked as
    the register checks them)."""
    if hashes is None:
        hashes = tier.manager.prefix.prompt_hashes(tenant, prompt_token_ids, public_prefix_len, cache_extra_key)
    return stage(tier, hashes)


def finish(tier: HostTier, staged: StagedRestore, ok: bool) -> int:
    """The restore copies completed (``ok``: the blocks enter the prefix cache, matchable) or failed (the slots
    are fenced: dropped from the tier; the fresh blocks go back to the free list). Either way the staging's
    references go: idle cached blocks park on the LRU. Returns how many blocks were restored."""
    allocator = tier.manager.allocator
    slots = staged.pairs[:, 0].tolist()
    del tier.restoring[staged.key]
    del tier.manager.held_outside[staged.key]
    if ok:
        for block_id, entry in zip(staged.pairs[:, 1].tolist(), staged.entries):
            allocator.cache.insert(block_id, entry)
        tier.unpin(slots)
        tier.num_restored += len(slots)
    else:
        tier.fence(slots)
    allocator.decref(staged.chain)
    return len(slots) if ok else 0
