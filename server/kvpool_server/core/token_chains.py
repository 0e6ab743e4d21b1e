"""TokenChains: the token ids and block hashes of the sequences whose appends carry their tokens, and sealing."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpool_server.core.block_hash import NONE_HASH, block_hash, salt_of
from kvpool_server.core.prefix_cache import CachedBlock, PrefixCache

EMPTY_TOKENS = np.zeros(0, dtype=np.uint32)


@dataclass
class Chain:
    """One tracked row: the hash of each of its full blocks (logical order), how many of them are sealed, the
    token ids of the full blocks not yet sealed, and those of its partly filled last block. Its first
    ``num_public`` blocks are hashed with PUBLIC_SALT, the others with ``salt`` (the tenant's); all with ``extra``
    (the sequence's cache_extra_key). A fork's children copy it: they inherit both."""

    salt: bytes
    hashes: list[bytes] = field(default_factory=list)
    num_sealed: int = 0
    pending_tokens: list[np.ndarray] = field(default_factory=list)  # of hashes[num_sealed:]
    partial: np.ndarray = field(default_factory=lambda: EMPTY_TOKENS)
    extra: bytes = b""
    num_public: int = 0

    def copy(self) -> Chain:
        return Chain(self.salt, list(self.hashes), self.num_sealed, list(self.pending_tokens), self.partial.copy(),
                     self.extra, self.num_public)


class TokenChains:
    """Which rows are tracked (every token they hold came with its id) and, for each, its ``Chain``.

    Sealing: a full block becomes matchable (``PrefixCache.insert``) only with the *next* call of the sequence that
    filled it -- its next append -- because the caller writes a block's KV after the append that allocated it
    returns; its next append is the signal that the step's KV is written. Until then no other sequence matches it,
    and a sequence freed (or a session dying) before sealing leaves nothing matchable.

    A row stops being tracked at an append without token ids (its pending blocks are sealed first: that append is
    still its next call). ``tracked`` is a bool array over rows so that an append without token ids costs one gather
    and one count while some rows are tracked, and nothing while none are (``num_tracked == 0``).

    Invariants: ``tracked`` marks exactly the rows of ``chains``; a chain of a row with n tokens holds
    ``n // block_size`` hashes, and ``n % block_size`` partial tokens (``checks.check_chains``).
    """

    def __init__(self, block_size: int, max_rows: int) -> None:
        self.block_size: int = block_size
        self.tracked: np.ndarray = np.zeros(max_rows, dtype=bool)
        self.chains: dict[int, Chain] = {}

    @property
    def num_tracked(self) -> int:
        return len(self.chains)

    def start(self, row: int, salt: bytes, hashes: list[bytes], extra: bytes = b"", num_public: int = 0) -> None:
        """Track ``row``, whose first ``len(hashes)`` full blocks are sealed cached blocks with those hashes."""
        self.chains[row] = Chain(salt, list(hashes), len(hashes), extra=extra, num_public=num_public)
        self.tracked[row] = True

    def drop(self, rows: list[int]) -> None:
        if self.chains:
            for row in rows:
                if self.chains.pop(row, None) is not None:
                    self.tracked[row] = False

    def fork(self, parent_row: int, child_rows: list[int]) -> None:
        chain = self.chains.get(parent_row)
        if chain is not None:
            for row in child_rows:
                self.chains[row] = chain.copy()
                self.tracked[row] = True

    def after_append(self, rows: np.ndarray, counts: np.ndarray, lengths_before: np.ndarray,
                     token_ids: np.ndarray | None, table: np.ndarray, cache: PrefixCache,
                     salts: list[bytes]) -> list[tuple[int, int]]:
        """After a successful append to ``rows`` (``counts`` tokens each, ``token_ids`` all of them concatenated in
        row order, or None): seal the rows' pending blocks, then extend (or start, for an empty row; ``salts`` is
        each row's salt) or stop tracking them. Returns the (row, block) of each public block it sealed."""
        public: list[tuple[int, int]] = []
        if token_ids is None:
            for row in rows[self.tracked.take(rows)].tolist():
                self._seal(row, table, cache, public)
                self.drop([row])
            return public
        ends = np.cumsum(counts)
        for i, row in enumerate(rows.tolist()):
            chain = self.chains.get(row)
            if chain is not None:
                self._seal(row, table, cache, public)
            elif lengths_before[i] == 0:
                chain = self.chains[row] = Chain(salts[i])
                self.tracked[row] = True
            else:
                continue
            self._extend(chain, token_ids[ends[i] - counts[i] : ends[i]])
        return public

    def _seal(self, row: int, table: np.ndarray, cache: PrefixCache, public: list[tuple[int, int]]) -> None:
        """Insert the row's pending full blocks in the cache; append (row, block) to ``public`` for each public one
        inserted (the ledger starts counting its references per tenant)."""
        chain = self.chains[row]
        for i in range(chain.num_sealed, len(chain.hashes)):
            parent = chain.hashes[i - 1] if i else NONE_HASH
            block_id = int(table[row, i])
            entry = CachedBlock(chain.hashes[i], parent, chain.pending_tokens[i - chain.num_sealed],
                                salt_of(i, chain.num_public, chain.salt), chain.extra)
            if cache.insert(block_id, entry) and i < chain.num_public:
                public.append((row, block_id))
        chain.num_sealed = len(chain.hashes)
        chain.pending_tokens = []

    def _extend(self, chain: Chain, token_ids: np.ndarray) -> None:
        tokens = np.concatenate([chain.partial, token_ids]) if chain.partial.size else token_ids
        bs, start = self.block_size, 0
        while tokens.size - start >= bs:
            block = tokens[start : start + bs].copy()
            i = len(chain.hashes)
            chain.hashes.append(block_hash(chain.hashes[-1] if i else NONE_HASH, block,
                                           salt_of(i, chain.num_public, chain.salt), chain.extra))
            chain.pending_tokens.append(block)
            start += bs
        chain.partial = tokens[start:].copy()
