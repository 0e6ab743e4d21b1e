"""Chain: one tracked row's hashes (how many of its blocks are sealed, the last one's hash, those pending), the
record ``TokenChains`` keeps per row; its pending blocks, one ``PendingRun``, and their columns for a seal."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat
from itertools import chain as chained
from operator import attrgetter
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


_PARENT, _SALT, _EXTRA = attrgetter("parent"), attrgetter("salt"), attrgetter("extra")
_NUM_PUBLIC, _TOKENS = attrgetter("num_public"), attrgetter("tokens")

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


def run_columns(runs: list[PendingRun], hash_runs: list[Sequence[bytes]]
                ) -> tuple[list[bytes], list[bytes], np.ndarray, list[bytes], list[bytes]]:
    """The blocks of ``runs`` (``hash_runs``: their hashes) as ``PrefixCache.insert_blocks``'s columns: hashes,
    parents, token ids (one array, a copy unless one run's own), salts, extra keys; each made in a few calls
    over the runs, not the blocks (a prefill's seal: a few thousand blocks of a few hundred runs)."""
    hashes = list(chained.from_iterable(hash_runs))
    counts = list(map(len, hash_runs))
    parents = [b"", *hashes[:-1]]  # a block's parent is the block before it, but for each run's first
    for first, parent in zip(accumulate(counts, initial=0), map(_PARENT, runs)):
        parents[first] = parent
    run_salts, run_extras = list(map(_SALT, runs)), list(map(_EXTRA, runs))
    if any(map(_NUM_PUBLIC, runs)):
        salts = list(chained.from_iterable([[PUBLIC_SALT] * run.num_public + [run.salt] * (num - run.num_public)
                                            for run, num in zip(runs, counts)]))
    elif run_salts.count(run_salts[0]) == len(runs):  # one tenant's
        salts = [run_salts[0]] * len(hashes)
    else:
        salts = list(chained.from_iterable(map(repeat, run_salts, counts)))
    if run_extras.count(run_extras[0]) == len(runs):
        extras = [run_extras[0]] * len(hashes)
    else:
        extras = list(chained.from_iterable(map(repeat, run_extras, counts)))
    if FilledBlock in {run.__class__ for run in runs}:  # a pending_tokens row each (rewritten later: copied)
        pieces = [run.tokens[run.at : run.at + 1] if run.__class__ is FilledBlock else run.tokens for run in runs]
        return hashes, parents, np.concatenate(pieces), salts, extras
    tokens = runs[0].tokens if len(runs) == 1 else np.concatenate(list(map(_TOKENS, runs)))  # whole: own runs
    return hashes, parents, tokens, salts, extras
