"""TokenChains: the token ids and block hashes of the sequences whose appends carry their tokens, and sealing."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpool_server.core.block_hash import NONE_HASH, block_hash, salt_of
from kvpool_server.core.prefix_cache import CachedBlock, PrefixCache

EMPTY_TOKENS = np.zeros(0, dtype=np.uint32)


@dataclass(eq=False)  # one object shared by sharers: identity, not value
class PendingBlocks:
    """Full blocks hashed but not sealed yet: their hashes and token ids (logical order), and whether they have been
    sealed. A fork's children share their parent's (the same blocks: a full block is never copied on write), so the
    first of them to seal seals them for all, and a fork copies none of them."""

    hashes: list[bytes] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    sealed: bool = False


NO_PENDING = PendingBlocks(sealed=True)  # shared by every chain with nothing pending; never appended to


@dataclass
class Chain:
    """One tracked row: how many of its full blocks are sealed and the hash of the last of them (``sealed_hash``,
    the parent of the next; NONE_HASH when none), its full blocks not yet sealed (``pending``, which its fork's
    children share), and the token ids of its partly filled last block. Its first ``num_public`` blocks are hashed
    with PUBLIC_SALT, the others with ``salt`` (the tenant's); all with ``extra`` (the sequence's cache_extra_key).
    A fork's children copy it: they inherit both. The sealed blocks' own hashes live in the prefix cache (the chain
    needs only the last), so a copy costs the same at 32,768 tokens as at 16 (a Fork of 4,095 children copies
    4,095 chains)."""

    salt: bytes
    num_sealed: int = 0
    sealed_hash: bytes = NONE_HASH
    pending: PendingBlocks = NO_PENDING
    partial: np.ndarray = field(default_factory=lambda: EMPTY_TOKENS)
    extra: bytes = b""
    num_public: int = 0

    @property
    def num_hashes(self) -> int:
        """Full blocks hashed: sealed and pending."""
        return self.num_sealed + len(self.pending.hashes)

    def copy(self) -> Chain:
        """A chain of its own that shares ``pending`` (never appended to once shared: ``_extend`` starts a new
        one) and ``partial`` (never written, only replaced)."""
        return Chain(self.salt, self.num_sealed, self.sealed_hash, self.pending, self.partial, self.extra,
                     self.num_public)


class TokenChains:
    """Which rows are tracked (every token they hold came with its id) and, for each, its ``Chain``.

    Sealing: a full block becomes matchable (``PrefixCache.insert``) only with the *next* call of the sequence that
    filled it -- its next append -- because the caller writes a block's KV after the append that allocated it
    returns; its next append is the signal that the step's KV is written. Until then no other sequence matches it,
    and a sequence freed (or a session dying) before sealing leaves nothing matchable.

    A row stops being tracked at an append without token ids (its pending blocks are sealed first: that append is
    still its next call). ``tracked`` is a bool array over rows so that an append without token ids costs one gather
    and one count while some rows are tracked, and nothing while none are (``num_tracked == 0``).

    Invariants: ``tracked`` marks exactly the rows of ``chains``; a chain of a row with n tokens has hashed
    ``n // block_size`` blocks (``num_hashes``) and holds ``n % block_size`` partial tokens; it holds the token ids
    of each pending block (``checks.check_chains``).
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
        self.chains[row] = Chain(salt, len(hashes), hashes[-1] if hashes else NONE_HASH, extra=extra,
                                 num_public=num_public)
        self.tracked[row] = True

    def drop(self, rows: list[int]) -> None:
        if self.chains:
            for row in rows:
                if self.chains.pop(row, None) is not None:
                    self.tracked[row] = False

    def fork(self, parent_row: int, child_rows: list[int]) -> None:
        chain = self.chains.get(parent_row)
        if chain is not None:
            self.chains.update({row: chain.copy() for row in child_rows})
            self.tracked[child_rows] = True

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
        pending = chain.pending
        if not pending.hashes:
            return
        parent, first = chain.sealed_hash, chain.num_sealed
        if not pending.sealed:  # else a sharer (fork parent or child) sealed the same blocks already
            for k, block_hash_k in enumerate(pending.hashes):
                i = first + k
                block_id = int(table[row, i])
                entry = CachedBlock(block_hash_k, parent, pending.tokens[k], salt_of(i, chain.num_public, chain.salt),
                                    chain.extra)
                if cache.insert(block_id, entry) and i < chain.num_public:
                    public.append((row, block_id))
                parent = block_hash_k
            pending.sealed = True
        chain.num_sealed, chain.sealed_hash = chain.num_hashes, pending.hashes[-1]
        chain.pending = NO_PENDING

    def _extend(self, chain: Chain, token_ids: np.ndarray) -> None:
        """Add ``token_ids`` to the (sealed: nothing pending) chain: its new full blocks become a new ``pending``."""
        tokens = np.concatenate([chain.partial, token_ids]) if chain.partial.size else token_ids
        bs, start = self.block_size, 0
        if tokens.size >= bs:
            pending, last, i = PendingBlocks(), chain.sealed_hash, chain.num_sealed  # NONE_HASH for block 0
            while tokens.size - start >= bs:
                block = tokens[start : start + bs].copy()
                last = block_hash(last, block, salt_of(i, chain.num_public, chain.salt), chain.extra)
                pending.hashes.append(last)
                pending.tokens.append(block)
                start, i = start + bs, i + 1
            chain.pending = pending
        chain.partial = tokens[start:].copy()
