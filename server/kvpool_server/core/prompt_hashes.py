"""PromptHashes: the hashes a register computed for its prompt's blocks past the cached run, kept for the row's
prefill so that no prompt block is hashed twice."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import numpy as np

from kvpool_server.core.block_hash import chain_hashes
from kvpool_server.core.errors import InvariantViolationError

MAX_PROMPT_HASH_BYTES = 64 << 20  # token bytes + 32 bytes a hash, of every row's kept prompt blocks together


class SaltedChain(Protocol):
    """What the invariant check reads of a row's chain (``chain.Chain``)."""

    salt: bytes
    extra: bytes
    num_public: int


class PromptBlocks(NamedTuple):  # a tuple: the cheapest record to make (one a register)
    """Full prompt blocks of one row, hashed by its register but not part of its chain yet: logical blocks
    ``first`` on, their token ids (u32le ``token_bytes``, block after block) and their chain ``hashes``, the first
    one's parent being ``parent`` (the hash of block ``first - 1``, NONE_HASH for block 0)."""

    first: int
    parent: bytes
    hashes: list[bytes]
    token_bytes: bytes

    @property
    def num_bytes(self) -> int:
        return len(self.token_bytes) + 32 * len(self.hashes)


class PromptHashes:
    """Per tracked row, at most one ``PromptBlocks``: kept by ``register`` (``keep``) for the blocks past the run it
    found cached, taken by the row's next append that fills a block (``TokenChains._extend``: ``take``), whose
    blocks then reuse those hashes instead of hashing their tokens again -- exactly, for the leading blocks whose
    token bytes equal the kept ones and only where the chain is still where the register left it (its sealed blocks
    end at ``first``, with hash ``parent``): a block's hash is a function of its parent's hash, its index's salt,
    the chain's extra key and its tokens. An append that uses some of them leaves the rest for the next (a prefill
    in chunks); one that cannot use them drops them; the row's end drops its entry too (``forget``).

    Bounded in bytes: the entries hold ``num_bytes`` (their tokens' bytes and 32 bytes a hash) of at most
    ``max_bytes`` (MAX_PROMPT_HASH_BYTES, 64 MiB, by default); a register that would exceed it keeps nothing (its
    prefill hashes its blocks as if it had no entry).

    Invariants (``check_invariants``): every entry's row is tracked; ``num_bytes`` is the sum of the entries' sizes,
    at most ``max_bytes``; an entry's hashes are the chain hashes of its token bytes from ``parent``, with its
    row's salt, extra key and public prefix.
    """

    def __init__(self, block_size: int, max_bytes: int = MAX_PROMPT_HASH_BYTES) -> None:
        self.block_bytes: int = 4 * block_size
        self.max_bytes: int = max_bytes
        self.entries: dict[int, PromptBlocks] = {}
        self.num_bytes: int = 0

    def keep(self, row: int, blocks: PromptBlocks) -> None:
        """Keep ``blocks`` for ``row`` (which has no entry), unless they would exceed ``max_bytes``."""
        size = blocks.num_bytes
        if blocks.hashes and self.num_bytes + size <= self.max_bytes:
            self.entries[row] = blocks
            self.num_bytes += size

    def take(self, row: int, num_sealed: int, sealed_hash: bytes, token_bytes: bytes) -> list[bytes]:
        """The hashes of the leading full blocks of ``token_bytes`` (whole blocks: the next ones of a chain whose
        ``num_sealed`` sealed blocks end with ``sealed_hash``, nothing pending) that ``row``'s entry holds: its first
        hashes where it starts there and its bytes and ``token_bytes`` agree as far as both go; else none. The entry
        goes, but for the blocks past ``token_bytes`` when they were used (a prefill in chunks: the next chunk's)."""
        entry = self.entries.pop(row, None)
        if entry is None:
            return []
        self.num_bytes -= entry.num_bytes
        if entry.first != num_sealed or entry.parent != sealed_hash:
            return []
        kept = entry.token_bytes
        if len(kept) <= len(token_bytes):
            return entry.hashes if token_bytes.startswith(kept) else []
        if not kept.startswith(token_bytes):
            return []
        num = len(token_bytes) // self.block_bytes
        hashes = entry.hashes
        self.keep(row, PromptBlocks(num_sealed + num, hashes[num - 1], hashes[num:], kept[len(token_bytes) :]))
        return hashes[:num]

    def forget(self, rows: list[int]) -> None:
        if self.entries:
            for row in rows:
                entry = self.entries.pop(row, None)
                if entry is not None:
                    self.num_bytes -= entry.num_bytes

    def check_invariants(self, chains: Mapping[int, SaltedChain]) -> None:
        """The class docstring's invariants, given the tracked rows' chains."""
        if not set(self.entries) <= set(chains):
            raise InvariantViolationError("a row that is not tracked keeps prompt hashes")
        if self.num_bytes != sum(e.num_bytes for e in self.entries.values()) or self.num_bytes > self.max_bytes:
            raise InvariantViolationError(f"PromptHashes.num_bytes={self.num_bytes} disagrees with its entries")
        for row, e in self.entries.items():
            chain = chains[row]
            tokens = np.frombuffer(e.token_bytes, dtype="<u4")
            if len(e.token_bytes) != len(e.hashes) * self.block_bytes or e.hashes != chain_hashes(
                    tokens, self.block_bytes // 4, chain.salt, e.parent, chain.extra, max(0, chain.num_public - e.first)):
                raise InvariantViolationError(f"row {row}'s kept prompt hashes disagree with their tokens")
