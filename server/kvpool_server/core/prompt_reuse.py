"""A register's prompt against the prefix cache: the chain hashes it may reuse, and the cached run it starts with.

``reuse_prefix`` is the part of ``KVCacheManager.register`` with ``prompt_token_ids`` (docs/prefix-caching.md): it
takes the manager's parts as plain arguments and changes them only when the register is certain to succeed (the
row is acquired). ``reusable_hashes`` are the hashes it matches -- the ones a restore from the host tier walks
(``KVCacheManager.prompt_hashes``, ``tier_restore.stage``).
"""

from __future__ import annotations

import numpy as np

from kvpool_server.core.block_hash import NONE_HASH, chain_hashes
from kvpool_server.core.block_tables import BlockTables
from kvpool_server.core.prompt_hashes import PromptBlocks
from kvpool_server.core.tenants import TenantLedger
from kvpool_server.core.token_chains import TokenChains
from kvpool_server.core.types import EMPTY_BLOCKS


def reusable_hashes(prompt: np.ndarray, block_size: int, salt: bytes, num_public: int, extra: bytes) -> list[bytes]:
    """The chain hashes of the prompt's full blocks a register may reuse (all but the last token's)."""
    bs = block_size
    return chain_hashes(prompt[: max(0, (prompt.size - 1) // bs) * bs], bs, salt, extra=extra, num_public=num_public)


def reuse_prefix(tables: BlockTables, tenants: TenantLedger, chains: TokenChains, tenancy: bool, row: int,
                 tenant: int, prompt: np.ndarray, public_prefix_len: int, extra: bytes) -> None:
    """Start the new ``row`` with the cached full blocks of ``prompt`` (at most ``(len - 1) // block_size``: one
    token is always left to compute), within the tenant's budget for blocks new to it
    (``TenantLedger.adoptable``, with ``tenancy`` on), and track it. Its first ``public_prefix_len // block_size``
    blocks are public (hashed with PUBLIC_SALT). The hashes of every full block of the prompt past the run it
    starts with are kept for its prefill (``TokenChains.prompts``), which then does not hash them again."""
    allocator, bs = tables.allocator, tables.block_size
    salt, cache, num_public = tenants.names[tenant].encode(), allocator.cache, public_prefix_len // bs
    num_full = prompt.size // bs
    hashes = chain_hashes(prompt[: num_full * bs], bs, salt, extra=extra, num_public=num_public)
    matched = cache.match(hashes[: max(0, (prompt.size - 1) // bs)])
    blocks = np.array(matched, dtype=np.int32) if matched else EMPTY_BLOCKS
    if blocks.size and tenancy:
        public = cache.is_public[blocks] if cache.num_public else None
        revived = allocator.ref_count[blocks] == 0
        if tenants.limited:
            num = tenants.adoptable(tenant, blocks, revived, public, allocator.num_allocatable)
            blocks, revived = blocks[:num], revived[:num]
            public = None if public is None else public[:num]
        tenants.charge_adopted(tenant, blocks, revived, public)
    if blocks.size:
        tables.adopt(row, blocks)
    num = blocks.size
    chains.start(row, salt, hashes[:num], extra, num_public)
    if num < num_full:
        chains.prompts.keep(row, PromptBlocks(num, hashes[num - 1] if num else NONE_HASH, hashes[num:],
                                              prompt[num * bs : num_full * bs].tobytes()))
