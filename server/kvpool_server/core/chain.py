"""Chain: one tracked row's hashes (how many of its blocks are sealed, the last one's hash, those pending), the
record ``TokenChains`` keeps per row."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvpool_server.core.block_hash import NONE_HASH, PUBLIC_SALT
from kvpool_server.core.kv_event_types import CachedBlock


class PendingRun(NamedTuple):
    """A chain's full blocks hashed but not sealed yet, in logical order, kept compact: their ``hashes``, their
    token ids as rows ``at`` .. ``at + len(hashes) - 1`` of ``tokens`` (uint32 [*, block_size], read-only, over one
    bytes object: a prompt's blocks, or a decode step's filled blocks of every row), the first one's ``parent``
    (the chain's ``sealed_hash`` when hashed), the chain's ``salt`` and ``extra`` key, and how many of the leading
    ones are public (``num_public``: hashed with PUBLIC_SALT). One tuple per run, whatever its length: no
    ``CachedBlock`` per block until one is read. A run but a ``FilledBlock`` owns its ``tokens`` whole (``at``
    0, one row a block).

    Read as a sequence of ``CachedBlock`` (``len``, iteration, ``block``): what each block's hash was computed
    from, made on read. A plain tuple while one chain holds it; a fork makes it ``SharedPending``, which its
    children and the parent share."""

    hashes: Sequence[bytes]
    tokens: np.ndarray
    at: int
    parent: bytes
    salt: bytes
    extra: bytes
    num_public: int

    def __len__(self) -> int:
        return len(self.hashes)

    def __iter__(self) -> Iterator[CachedBlock]:  # type: ignore[override]
        return map(self.block, range(len(self.hashes)))

    def block(self, k: int) -> CachedBlock:
        """Block ``k`` of the run (0 <= k < len) as a ``CachedBlock``: its token ids a view of ``tokens``."""
        hashes = self.hashes
        return CachedBlock(hashes[k], hashes[k - 1] if k else self.parent, self.tokens[self.at + k],
                           PUBLIC_SALT if k < self.num_public else self.salt, self.extra)

    def __reduce__(self) -> tuple[Any, ...]:  # a copy (deepcopy, pickle) of the fields, not of the blocks read
        state = getattr(self, "__dict__", None)  # SharedPending's ``sealed``
        return (tuple.__new__, (self.__class__, tuple(tuple.__iter__(self))), *((state,) if state else ()))


# A chain's pending blocks: a run, or none.
PendingBlocks = PendingRun | tuple[()]
NO_PENDING: PendingBlocks = ()


class FilledBlock(PendingRun):
    """The one block a decode step filled, pending: its token ids are row ``at`` (its chain's row) of
    ``TokenChains.pending_tokens``, which holds them until its chain seals it (a seal of many gathers them in one
    index), the run's ``tokens`` being that array as it was when the block was hashed (later grown, never
    rewritten)."""


class SharedPending(PendingRun):
    """Pending blocks that a fork's children share with their parent (the same blocks: a full block is never copied
    on write): the first of them to seal inserts them -- whatever the cache answers, a hash held by another block
    included -- and marks them ``sealed``; the others' seals then insert nothing. Its token ids are its own copy
    (a ``FilledBlock``'s row is rewritten by its row's next block)."""

    sealed: bool = False

    @classmethod
    def of(cls, run: PendingRun) -> SharedPending:
        """The same blocks, shared: their token rows copied into an array of their own."""
        hashes, tokens, at = run.hashes, run.tokens, run.at
        own = tokens[at : at + len(hashes)].copy()
        own.flags.writeable = False
        return tuple.__new__(cls, (hashes, own, 0, run.parent, run.salt, run.extra, run.num_public))


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
