"""PrefixReuse: a register's prompt against the prefix cache -- the cached run it starts with, the prompt's hashes
(which a host tier's restore before the register walks too: ``offload.restore``), and the hit counters
(docs/prefix-caching.md)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool_server.core.block_hash import NONE_HASH, block_header, chain_encoded, chain_hashes
from kvpool_server.core.block_tables import BlockTables
from kvpool_server.core.call_args import check_register_args
from kvpool_server.core.chain import NO_PENDING, Chain
from kvpool_server.core.prompt_hashes import PromptBlocks
from kvpool_server.core.tenants import DEFAULT_TENANT, TenantLedger
from kvpool_server.core.token_chains import TokenChains
from kvpool_server.core.types import EMPTY_BLOCKS


def reusable_hashes(prompt: np.ndarray, block_size: int, salt: bytes, num_public: int, extra: bytes) -> list[bytes]:
    """The chain hashes of the prompt's full blocks a register may reuse (all but the last token's)."""
    bs = block_size
    return chain_hashes(prompt[: max(0, (prompt.size - 1) // bs) * bs], bs, salt, extra=extra, num_public=num_public)


class PrefixReuse:
    """The manager's prefix-cache side of ``register`` with ``prompt_token_ids``, over the manager's parts (passed
    to the constructor; nothing here reaches into the manager).

    ``start`` begins a new row with the prompt's cached run and tracks it (a host tier brings the prompt's blocks
    back into the cache before the register: ``offload.restore``, over ``prompt_hashes``). The salt is the tenant's
    name, so different tenants never share a block -- except the blocks of a public prefix (``public_prefix_len``),
    hashed with PUBLIC_SALT, which any tenant may adopt. Counters (since start, in tokens; PoolStats):
    ``query_tokens`` of prompts registered with their ids, ``hit_tokens`` of them found cached (vLLM's
    prefix_cache_queries / _hits; a host tier's restored blocks count too, as its ``host_hit_tokens``).
    """

    def __init__(self, tables: BlockTables, tenants: TenantLedger, chains: TokenChains, tenancy: bool,
                 max_seq_len: int) -> None:
        self.tables: BlockTables = tables
        self.tenants: TenantLedger = tenants
        self.chains: TokenChains = chains
        self.tenancy: bool = tenancy
        self.max_seq_len: int = max_seq_len
        self.query_tokens: int = 0
        self.hit_tokens: int = 0

    def start(self, row: int, tenant: int, prompt: np.ndarray, public_prefix_len: int, extra: bytes,
              reusable: list[bytes] | None = None) -> None:
        """Start the new ``row`` with the cached full blocks of ``prompt`` (at most ``(len - 1) // block_size``: one
        token is always left to compute), within the tenant's budget for blocks new to it
        (``TenantLedger.adoptable``), and track it. Its first ``public_prefix_len // block_size`` blocks are public
        (hashed with PUBLIC_SALT). The hashes of every full block of the prompt past the run it starts with are kept
        for its prefill (``TokenChains.prompts``), which then does not hash them again. ``reusable``: this prompt's
        ``prompt_hashes`` for this tenant, computed before the lock (only the last full block is hashed here then)."""
        tables, allocator, bs = self.tables, self.tables.allocator, self.tables.block_size
        salt, cache, num_public = self.tenants.names[tenant].encode(), allocator.cache, public_prefix_len // bs
        num_full = prompt.size // bs
        done = reusable if reusable is not None and len(reusable) == max(0, (prompt.size - 1) // bs) else []
        k = len(done)
        hashes = done + chain_hashes(prompt[k * bs : num_full * bs], bs, salt, parent_hash=done[-1] if k else NONE_HASH,
                                     extra=extra, num_public=max(0, num_public - k))
        matched = cache.match(hashes[: max(0, (prompt.size - 1) // bs)])
        blocks = np.array(matched, dtype=np.int32) if matched else EMPTY_BLOCKS
        if blocks.size and self.tenancy:
            ledger = self.tenants
            public = cache.is_public[blocks] if cache.num_public else None
            revived = allocator.ref_count[blocks] == 0
            if ledger.limited:
                num = ledger.adoptable(tenant, blocks, revived, public, allocator.num_allocatable)
                blocks, revived = blocks[:num], revived[:num]
                public = None if public is None else public[:num]
            ledger.charge_adopted(tenant, blocks, revived, public)
        if blocks.size:
            tables.adopt(row, blocks)
        num = blocks.size
        self.chains.start(row, salt, hashes[:num], extra, num_public)
        if num < num_full:
            self.chains.prompts.keep(row, PromptBlocks(num, hashes[num - 1] if num else NONE_HASH, hashes[num:],
                                                       prompt[num * bs : num_full * bs].tobytes()))
        self.query_tokens += int(prompt.size)
        self.hit_tokens += tables.num_tokens.item(row)

    def start_many(self, rows: list[int], tenant: int, prompts: Sequence[np.ndarray | None]) -> None:
        """``start(rows[i], tenant, prompts[i], 0, b"")`` of each prompt that is not None, in order -- a burst's
        prompts with no public prefix, extra key or precomputed hashes, tenancy off (else ``start`` each) -- with
        the salt's header made once, each prompt hashed in one ``chain_encoded`` over its bytes (made once: its
        kept blocks are a slice of them), its chain made in place and the rows tracked in one scatter."""
        if self.tenancy:
            for row, prompt in zip(rows, prompts):
                if prompt is not None:
                    self.start(row, tenant, prompt, 0, b"")
            return
        tables, chains, bs = self.tables, self.chains, self.tables.block_size
        salt, block_of_hash = self.tenants.names[tenant].encode(), tables.allocator.cache.block_of_hash
        header, keep, by_row, block_bytes = block_header(salt, b"", bs), chains.prompts.keep, chains.chains, bs * 4
        started, query, hit = [], 0, 0
        for row, prompt in zip(rows, prompts):
            if prompt is None:
                continue
            data = prompt.tobytes()  # uint32 (``prompt_of``), as its hashes read it
            hashes = chain_encoded(data, bs, salt)
            num_full, size = len(hashes), prompt.size
            num = 0
            if hashes and size > bs and hashes[0] in block_of_hash:  # a cached run (else none: distinct prompts)
                matched = self.tables.allocator.cache.match(hashes[: (size - 1) // bs])
                tables.adopt(row, np.array(matched, dtype=np.int32))
                num = len(matched)
            by_row[row] = Chain(salt, num, hashes[num - 1] if num else NONE_HASH, NO_PENDING, b"", 0, header, b"")
            started.append(row)
            if num < num_full:
                keep(row, PromptBlocks(num, hashes[num - 1] if num else NONE_HASH, hashes[num:],
                                       data[num * block_bytes : num_full * block_bytes]))
            query += size
            hit += num * bs
        if started:
            chains.track(started)
        self.query_tokens += query
        self.hit_tokens += hit

    def prompt_hashes(self, tenant: int | None, prompt_token_ids: Sequence[int] | np.ndarray,
                      public_prefix_len: int = 0, cache_extra_key: bytes = b"") -> list[bytes]:
        """The chain hashes a register of this prompt matches (checked as ``register`` checks it). Reads only the
        tenant's name (``TenantLedger.names`` only grows): the service may call it without the lock."""
        prompt, salt, num_public = self.hash_input(tenant, prompt_token_ids, public_prefix_len, cache_extra_key)
        return reusable_hashes(prompt, self.tables.block_size, salt, num_public, cache_extra_key)

    def hash_input(self, tenant: int | None, prompt_token_ids: Sequence[int] | np.ndarray, public_prefix_len: int = 0,
                   cache_extra_key: bytes = b"") -> tuple[np.ndarray, bytes, int]:
        """What ``prompt_hashes`` hashes -- the prompt (checked as ``register`` checks it), the tenant's salt, the
        number of public blocks -- for a caller that hashes it in chunks (``reusable_hashes`` of it, chained)."""
        prompt = np.asarray(prompt_token_ids, dtype=np.uint32)
        check_register_args(prompt, public_prefix_len, cache_extra_key, self.max_seq_len)
        tenant = DEFAULT_TENANT if tenant is None or not self.tenancy else tenant
        return prompt, self.tenants.names[tenant].encode(), public_prefix_len // self.tables.block_size
