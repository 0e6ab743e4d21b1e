"""Chain: one tracked row's hashes (how many of its blocks are sealed, the last one's hash, those pending), the
record ``TokenChains`` keeps per row."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool_server.core.block_hash import NONE_HASH
from kvpool_server.core.kv_event_types import CachedBlock


# A chain's full blocks hashed but not sealed yet, in logical order: each one's ``CachedBlock`` (its hash, its
# parent's, its token ids, salt and extra key: the prefix cache's entry once sealed, made when it is hashed). A
# plain tuple while one chain holds them (a decode step makes one a filled block: no other object); a fork makes
# them ``SharedPending``, which its children and the parent share.
PendingBlocks = tuple[CachedBlock, ...]
NO_PENDING: PendingBlocks = ()


class SharedPending(tuple[CachedBlock, ...]):
    """Pending blocks that a fork's children share with their parent (the same blocks: a full block is never copied
    on write): the first of them to seal inserts them -- whatever the cache answers, a hash held by another block
    included -- and marks them ``sealed``; the others' seals then insert nothing."""

    sealed: bool = False


@dataclass(slots=True)
class Chain:
    """One tracked row's hashes: how many of its full blocks are sealed and the hash of the last of them
    (``sealed_hash``, the parent of the next; NONE_HASH when none), and its full blocks not yet sealed
    (``pending``, which its fork's children share). Its first ``num_public`` blocks are hashed with PUBLIC_SALT, the
    others with ``salt`` (the tenant's); all with ``extra`` (the sequence's cache_extra_key). A fork's children copy
    it: they inherit both. The sealed blocks' own hashes live in the prefix cache (the chain needs only the last),
    so a copy costs the same at 32,768 tokens as at 16 (a Fork of 4,095 children copies 4,095 chains). The tokens
    of its partly filled last block live in ``TokenChains.partial``."""

    salt: bytes
    num_sealed: int = 0
    sealed_hash: bytes = NONE_HASH
    pending: PendingBlocks = NO_PENDING
    extra: bytes = b""
    num_public: int = 0
    header: bytes = b""  # block_header(salt, extra, block_size): every block's but the public ones'
    public_header: bytes = b""  # block_header(PUBLIC_SALT, extra, block_size)

    @property
    def num_hashes(self) -> int:
        """Full blocks hashed: sealed and pending."""
        return self.num_sealed + len(self.pending)

    def copy(self) -> Chain:
        """A chain of its own that shares ``pending`` (a tuple: never changed, only replaced)."""
        return Chain(self.salt, self.num_sealed, self.sealed_hash, self.pending, self.extra, self.num_public,
                     self.header, self.public_header)

    def header_of(self, block_index: int) -> bytes:
        """The ``block_header`` of logical block ``block_index`` (its salt: ``salt_of``)."""
        return self.public_header if block_index < self.num_public else self.header
