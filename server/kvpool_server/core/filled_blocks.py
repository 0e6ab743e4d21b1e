"""FilledBatch: the blocks one decode step filled (one a row), hashed at once, and their columns for the seal."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_

import numpy as np

from kvpool_server.core.block_hash import PUBLIC_SALT, hash_rows
from kvpool_server.core.chain import Chain, FilledBlock

_PENDING, _SEALED_HASH, _HEADER = attrgetter("pending"), attrgetter("sealed_hash"), attrgetter("header")
_SALT, _EXTRA, _NUM_PUBLIC = attrgetter("salt"), attrgetter("extra"), attrgetter("num_public")
_FILLED_FIELDS = attrgetter("hashes", "parent", "salt", "extra", "num_public")

# A seal's columns but the block ids and token ids: hashes, parents, salts, extra keys (PrefixCache.insert_blocks).
SealColumns = tuple[list[bytes], Sequence[bytes], Sequence[bytes], Sequence[bytes]]


@dataclass(eq=False)
class FilledBatch:
    """What ``hash_filled`` made for one decode step's ``rows`` (an int array, in the step's order): each row's
    ``FilledBlock`` (``runs``, which became the rows' chains' ``pending``) and the seal's columns of them --
    their ``hashes``, ``parents``, ``salts`` (PUBLIC_SALT for a public block) and ``extras`` -- made once, so that the
    next step's seal of the same rows reads no block (``seal_columns``); and the rows' ``chains`` with their
    ``headers`` (None when a block was public), so that the next filling of the same chains reads only their sealed
    hashes (``hash_filled``). A memo of the last step only (``TokenChains.filled``): a row sealed, dropped, forked
    or filled since makes it miss, never answer wrong. A plain object (a ``__dict__``): CheckInvariants' snapshot
    copies the core's objects field by field (service/invariant_checks.py ``copy_state``)."""

    rows: np.ndarray
    runs: list[FilledBlock]
    hashes: list[bytes]
    parents: list[bytes]
    salts: list[bytes]
    extras: list[bytes]
    chains: list[Chain]
    headers: list[bytes] | None


def hash_filled(chains: list[Chain], rows: np.ndarray, filled: np.ndarray, pending_tokens: np.ndarray,
                last: FilledBatch | None) -> FilledBatch:
    """Hash the blocks of the (sealed: nothing pending) ``chains`` of ``rows`` that the decode step just filled
    (``filled``: their token ids, one row each, written to ``pending_tokens`` already): one ``hash_rows``, each field
    a ``map``, one ``FilledBlock`` a chain made its ``pending``. Returns the batch. The salts, extra keys and headers
    are ``last``'s (the batch before) when it filled the same chains, in the same order, none of its blocks public
    (a chain's salt, extra key and headers never change; its blocks past the public prefix stay past it)."""
    parents = list(map(_SEALED_HASH, chains))
    publics: Sequence[int] | repeat[int] = repeat(0)
    if last is not None and last.headers is not None and len(last.chains) == len(chains) and \
            all(map(is_, chains, last.chains)):
        salts, extras, headers, seal_salts = last.salts, last.extras, last.headers, last.salts
        kept: list[bytes] | None = headers
    else:
        salts, extras = list(map(_SALT, chains)), list(map(_EXTRA, chains))
        if any(map(_NUM_PUBLIC, chains)) and any([c.num_sealed < c.num_public for c in chains]):  # a public block
            headers, kept = [chain.header_of(chain.num_sealed) for chain in chains], None
            publics = [int(c.num_sealed < c.num_public) for c in chains]
            seal_salts = [PUBLIC_SALT if public else salt for public, salt in zip(publics, salts)]
        else:
            headers = kept = list(map(_HEADER, chains))
            seal_salts = salts
    hashes = hash_rows(parents, headers, filled)
    fields = zip(zip(hashes), repeat(pending_tokens), rows.tolist(), parents, salts, extras, publics)
    runs = list(map(tuple.__new__, repeat(FilledBlock), fields))
    for chain, run in zip(chains, runs):
        chain.pending = run
    return FilledBatch(rows, runs, hashes, parents, seal_salts, extras, chains, kept)


def seal_columns(batch: FilledBatch | None, rows: np.ndarray, chains: list[Chain]) -> SealColumns | None:
    """The seal's columns of the pending blocks of ``chains`` (those of ``rows``) when each is one ``FilledBlock``,
    else None: ``batch``'s own when the chains' pending runs are exactly its runs, in its order (a decode step
    sealing what the step before filled: nothing read a block), else read from the runs (one pass)."""
    if batch is not None and batch.rows.dtype == rows.dtype and batch.rows.tobytes() == rows.tobytes() and \
            all(map(is_, map(_PENDING, chains), batch.runs)):
        return batch.hashes, batch.parents, batch.salts, batch.extras
    pendings = list(map(_PENDING, chains))
    if {p.__class__ for p in pendings} != {FilledBlock}:
        return None
    ones, parents, salts, extras, publics = zip(*map(_FILLED_FIELDS, pendings))  # ones: (hash,) each
    if any(publics):
        salts = tuple([PUBLIC_SALT if p.num_public else p.salt for p in pendings])
    return [h for h, in ones], parents, salts, extras
