"""TokenChains: the token ids and block hashes of the sequences whose appends carry their tokens, and sealing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

import numpy as np

from kvpool_server.core.block_hash import NONE_HASH, PUBLIC_SALT, block_header, chain_encoded, hash_encoded
from kvpool_server.core.chain import NO_PENDING, Chain, FilledBlock, PendingRun, SharedPending, run_columns
from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.core.filled_blocks import FilledBatch, hash_filled, seal_columns
from kvpool_server.core.prefix_cache import PrefixCache
from kvpool_server.core.prompt_hashes import PromptHashes

U32 = np.dtype("<u4")
_HASHES, _PENDING = attrgetter("hashes"), attrgetter("pending")

INITIAL_ROWS = 64  # rows of ``partial`` at first; doubled as higher rows are tracked, up to max_rows


class TokenChains:
    """Which rows are tracked (every token they hold came with its id) and, for each, its ``Chain`` and the token
    ids of its partly filled last block.

    Sealing: a full block becomes matchable (``PrefixCache.insert``) only with the *next* call of the sequence that
    filled it -- its next append -- because the caller writes a block's KV after the append that allocated it
    returns; its next append is the signal that the step's KV is written. Until then no other sequence matches it,
    and a sequence freed (or a session dying) before sealing leaves nothing matchable.

    A row stops being tracked at an append without token ids (its pending blocks are sealed first: that append is
    still its next call). ``tracked`` is a bool array over rows so that an append without token ids costs one gather
    and one count while some rows are tracked, and nothing while none are (``num_tracked == 0``).

    Arrays, so that a decode step (one token for each of many rows) is a few NumPy calls: ``partial[row, :fill[row]]``
    holds the row's partial tokens (uint32; ``partial`` has at most max_rows x block_size x 4 bytes: 256 KiB at 4,096
    rows of 16, grown by doubling as higher rows are tracked), ``pending_tokens[row]`` the token ids of the block a
    decode step filled while it is pending (a ``FilledBlock``; the same size as ``partial``, grown with it), and
    ``has_pending`` marks the rows whose chain has pending blocks. A chain's pending blocks are one ``PendingRun``
    (chain.py) -- hashes and one token array, no object a block -- and a seal hands the cache their columns
    (``PrefixCache.insert_blocks``). The step writes every row's token with one fancy-indexed assignment; only the rows that have
    pending blocks to seal, or whose block it filled (1 in 16 on average), go through Python -- hashing is per
    block -- each part of the work done for all of them at once where it can be (``_hash_filled``, ``_seal``), the
    chains' own fields set row by row. An append of several tokens to a row goes through Python too (a prompt: its
    blocks are hashed).

    Invariants (``check_invariants``): ``tracked`` marks exactly the rows of ``chains``, all live; a tracked row with
    n tokens has hashed ``n // block_size`` blocks (``num_hashes``) and holds ``fill[row] == n % block_size`` partial
    tokens; ``has_pending[row]`` is whether its chain has pending blocks (``num_pending`` counts them); an untracked
    row has ``fill`` 0 and ``has_pending`` false; a chain's pending entries chain from its ``sealed_hash``, each the
    hash of its block_size token ids with its block's salt and the chain's extra key, their token rows inside their
    run's uint32 ``[*, block_size]`` array and its ``num_public`` the number of them below the chain's public prefix (a
    ``FilledBlock``'s row is its chain's row of ``pending_tokens``); a chain's ``header`` (and
    ``public_header``, with a public prefix) is the ``block_header`` of its salt (PUBLIC_SALT) and extra key.
    """

    def __init__(self, block_size: int, max_rows: int) -> None:
        self.block_size: int = block_size
        self.max_rows: int = max_rows
        self.tracked: np.ndarray = np.zeros(max_rows, dtype=bool)
        self.has_pending: np.ndarray = np.zeros(max_rows, dtype=bool)
        self.num_pending: int = 0  # rows marked in has_pending: 0 in most decode steps, which then read none
        rows = min(INITIAL_ROWS, max_rows)
        self.partial: np.ndarray = np.zeros((rows, block_size), dtype=np.uint32)
        self.fill: np.ndarray = np.zeros(rows, dtype=np.intp)
        self.pending_tokens: np.ndarray = np.zeros((rows, block_size), dtype=np.uint32)  # FilledBlock's rows
        self.chains: dict[int, Chain] = {}
        self.prompts: PromptHashes = PromptHashes(block_size)  # a register's hashes of its prompt, for its prefill
        self.filled: FilledBatch | None = None  # the last decode step's filled blocks, for their seal (a memo)

    @property
    def num_tracked(self) -> int:
        return len(self.chains)

    def partial_tokens(self, row: int) -> np.ndarray:
        """A copy of the tracked row's partial tokens."""
        return self.partial[row, : self.fill.item(row)].copy()

    def start(self, row: int, salt: bytes, hashes: list[bytes], extra: bytes = b"", num_public: int = 0) -> None:
        """Track ``row``, whose first ``len(hashes)`` full blocks are sealed cached blocks with those hashes."""
        self._reserve(row + 1)
        bs = self.block_size
        self.chains[row] = Chain(salt, len(hashes), hashes[-1] if hashes else NONE_HASH, extra=extra,
                                 num_public=num_public, header=block_header(salt, extra, bs),
                                 public_header=block_header(PUBLIC_SALT, extra, bs) if num_public else b"")
        self.tracked[row] = True

    def track(self, rows: list[int]) -> None:
        """Mark ``rows`` tracked, their chains set already (``PrefixReuse.start_many``: sealed, nothing pending)."""
        self._reserve(max(rows) + 1)
        self.tracked[rows] = True

    def drop(self, rows: list[int]) -> None:
        if self.chains:
            pop = self.chains.pop
            dropped = [row for row in rows if pop(row, None) is not None]
            if dropped:  # one scatter per array (a free of hundreds of rows)
                self.num_pending -= np.count_nonzero(self.has_pending[dropped])
                self.tracked[dropped] = self.has_pending[dropped] = False
                self.fill[dropped] = 0
            self.prompts.forget(rows)

    def fork(self, parent_row: int, child_rows: list[int]) -> None:
        chain = self.chains.get(parent_row)
        if chain is not None:
            if chain.pending and chain.pending.__class__ is not SharedPending:
                chain.pending = SharedPending.of(chain.pending)
            self._reserve(max(child_rows) + 1)
            self.chains.update({row: chain.copy() for row in child_rows})
            self.tracked[child_rows] = True
            self.num_pending -= np.count_nonzero(self.has_pending[child_rows])
            self.has_pending[child_rows] = self.has_pending[parent_row]
            self.num_pending += len(child_rows) if self.has_pending.item(parent_row) else 0
            self.partial[child_rows] = self.partial[parent_row]
            self.fill[child_rows] = self.fill[parent_row]

    def after_append(self, rows: np.ndarray, counts: int | np.ndarray, lengths_before: np.ndarray,
                     token_ids: np.ndarray | None, table: np.ndarray, cache: PrefixCache,
                     salt_of_row: Callable[[int], bytes]) -> list[tuple[int, int]]:
        """After a successful append to ``rows`` (``counts`` tokens each: one int for all, or one per row;
        ``token_ids`` all of them concatenated in row order, or None): seal the rows' pending blocks (in the order
        of ``rows``), then extend (or start, for an empty row, with the salt ``salt_of_row(row)``) or stop tracking
        them. Returns the (row, block) of each public block it sealed."""
        public: list[tuple[int, int]] = []
        if token_ids is None:
            if self.chains:
                self._seal(rows[self.has_pending.take(rows)], table, cache, public)
                self.drop(rows[self.tracked.take(rows)].tolist())
            return public
        tracked = self.tracked.take(rows)
        all_tracked = np.count_nonzero(tracked) == rows.size
        if not all_tracked:  # start the empty rows; the others stay untracked
            starting = ~tracked & (lengths_before == 0)
            for row in rows[starting].tolist():
                self.start(row, salt_of_row(row), [])
            tracked |= starting
        pending = self.has_pending.take(rows) if self.num_pending else None
        if pending is not None and np.count_nonzero(pending):  # untracked rows have none; most steps seal nothing
            self._seal(rows[pending], table, cache, public)
        if token_ids.size == rows.size:  # one token per row (every count is >= 1): the decode step
            if not all_tracked:
                rows, token_ids = rows[tracked], token_ids[tracked]
            fill = self.fill.take(rows)
            self.partial[rows, fill] = token_ids
            fill += 1
            self.fill[rows] = fill
            filled = rows[fill == self.block_size]
            if filled.size:
                self.fill[filled] = 0
                self._hash_filled(filled)
            return public
        sizes = np.broadcast_to(counts, rows.shape)
        ends = np.cumsum(sizes)
        if not all_tracked:
            rows, sizes, ends = rows[tracked], sizes[tracked], ends[tracked]
        self._extend(rows, sizes, ends, token_ids)
        return public

    def _seal(self, row_array: np.ndarray, table: np.ndarray, cache: PrefixCache, public: list[tuple[int, int]]) -> None:
        """Insert the pending full blocks of ``row_array`` (each has some) in the cache, in order (one
        ``PrefixCache.insert_blocks`` for them all, by columns: hashes, parents, token ids, salts, extra keys);
        append (row, block) to ``public`` for each public one inserted (the ledger starts counting its references
        per tenant). When every row has one block pending of its own (a decode step's seal: ``FilledBlock``s), the
        columns are those the step that filled them made (``seal_columns``: its ``FilledBatch``, or one pass over
        the runs' fields) and their token ids one gather of ``pending_tokens``; only the chains' fields are set row
        by row."""
        if not row_array.size:
            return
        rows = row_array.tolist()
        chains = list(map(self.chains.__getitem__, rows))
        columns = seal_columns(self.filled, row_array, chains)  # the decode step's: each row's one FilledBlock
        if columns is not None:
            hashes = columns[0]
            block_ids = table[row_array, [chain.num_sealed for chain in chains]]
            for chain, h in zip(chains, hashes):
                chain.num_sealed += 1
                chain.sealed_hash = h
                chain.pending = NO_PENDING
            self.has_pending[row_array] = False
            self.num_pending -= row_array.size
            inserted = cache.insert_blocks(block_ids, hashes, columns[1], self.pending_tokens[row_array], *columns[2:])
            if inserted:
                public += [(rows[k], block_ids.item(k)) for k in inserted]
            return
        pendings: list[PendingRun] = list(map(_PENDING, chains))
        classes = {p.__class__ for p in pendings}
        hash_runs = list(map(_HASHES, pendings))
        if SharedPending not in classes:  # no fork shares them (a prefill's seal)
            self._seal_own(row_array, chains, pendings, hash_runs, table, cache, public)
            return
        shared_ids: list[int] = []
        runs: list[PendingRun] = []
        owners: list[int] = []  # the row of each block of ``runs``
        for row, chain in zip(rows, chains):
            new: PendingRun = chain.pending  # type: ignore[assignment]
            num = len(new.hashes)
            if not isinstance(new, SharedPending) or not new.sealed:  # else a sharer sealed the same blocks already
                if isinstance(new, SharedPending):
                    new.sealed = True
                shared_ids += table[row, chain.num_sealed : chain.num_sealed + num].tolist()
                runs.append(new)
                owners += [row] * num
            chain.num_sealed += num
            chain.sealed_hash = new.hashes[-1]
            chain.pending = NO_PENDING
        self.has_pending[rows] = False
        self.num_pending -= len(rows)
        if runs:
            for k in cache.insert_blocks(shared_ids, *run_columns(runs, list(map(_HASHES, runs)))):
                public.append((owners[k], shared_ids[k]))

    def _seal_own(self, row_array: np.ndarray, chains: list[Chain], pendings: list[PendingRun],
                  hash_runs: list[Sequence[bytes]], table: np.ndarray, cache: PrefixCache,
                  public: list[tuple[int, int]]) -> None:
        """``_seal`` of rows whose pending blocks are their own (no ``SharedPending``; a prefill's seal: a prompt's
        blocks each): every row's pending blocks gathered from the table in one index (the row repeated, its logical
        blocks from ``num_sealed`` on), the columns made run by run (``run_columns``), one ``insert_blocks``."""
        counts = np.fromiter(map(len, hash_runs), dtype=np.intp, count=len(hash_runs))
        firsts = np.fromiter([chain.num_sealed for chain in chains], dtype=np.intp, count=len(chains))
        owners = np.repeat(row_array, counts)
        ends = np.cumsum(counts)
        columns = np.arange(owners.size) + np.repeat(firsts - (ends - counts), counts)  # num_sealed, num_sealed + 1, ..
        block_ids = table[owners, columns]
        for chain, hashes in zip(chains, hash_runs):
            chain.num_sealed += len(hashes)
            chain.sealed_hash = hashes[-1]
            chain.pending = NO_PENDING
        self.has_pending[row_array] = False
        self.num_pending -= row_array.size
        for k in cache.insert_blocks(block_ids, *run_columns(pendings, hash_runs)):
            public.append((owners.item(k), block_ids.item(k)))

    def _extend(self, rows: np.ndarray, sizes: np.ndarray, ends: np.ndarray, token_ids: np.ndarray) -> None:
        """Add to the (sealed: nothing pending) chain of each of ``rows`` (distinct, tracked) its ``sizes`` tokens,
        those of ``token_ids`` that end at ``ends``: a row's new full blocks become its new ``pending``
        (``_hash_blocks``, row by row: their bytes one slice of the append's), the rest its partial tokens (written
        for all rows in one scatter)."""
        bs = self.block_size
        fills = self.fill.take(rows)
        totals = fills + sizes
        rests = totals % bs
        filling = totals >= bs
        if np.count_nonzero(filling):
            data, prompts, chains = token_ids.astype(U32, copy=False).tobytes(), self.prompts, self.chains
            starts = ends - sizes
            for row, fill, start, stop in zip(rows[filling].tolist(), fills[filling].tolist(),
                                              starts[filling].tolist(), (ends - rests)[filling].tolist()):
                full = data[start * 4 : stop * 4]  # the new full blocks' tokens, after the row's partial ones
                if fill:
                    full = self.partial[row, :fill].astype(U32, copy=False).tobytes() + full
                chain = chains[row]
                known = prompts.take(row, chain.num_sealed, chain.sealed_hash, full) if prompts.entries else []
                self._hash_blocks(row, chain, full, known)
        lengths = np.where(filling, rests, sizes)  # the tokens each row's partial block takes
        num = int(lengths.sum())
        if num:  # a row that filled a block keeps its last ``rests`` tokens from offset 0; another adds at ``fill``
            offsets = np.arange(num) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            self.partial[np.repeat(rows, lengths), np.repeat(np.where(filling, 0, fills), lengths) + offsets] = \
                token_ids[np.repeat(ends - lengths, lengths) + offsets]
        self.fill[rows] = rests

    def _hash_filled(self, rows: np.ndarray) -> None:
        """``_hash_blocks`` for ``rows`` whose partial block the decode step just filled (``fill`` already 0, nothing
        pending: the step sealed it first): one block each, their token ids gathered into ``pending_tokens`` at once,
        hashed in one ``hash_rows`` (``filled_blocks.hash_filled``: one ``FilledBlock`` a row); the step's batch kept
        (``filled``) for the seal of the same rows by their next step."""
        filled = self.partial.take(rows, axis=0)
        self.pending_tokens[rows] = filled
        self.filled = hash_filled(list(map(self.chains.__getitem__, rows.tolist())), rows, filled, self.pending_tokens,
                                  self.filled)
        self.has_pending[rows] = True
        self.num_pending += rows.size

    def _hash_blocks(self, row: int, chain: Chain, data: bytes, known: Sequence[bytes] = ()) -> None:
        """Hash new full blocks (``data``: their token ids, u32le, block after block) of the sealed chain of ``row``:
        they become its ``pending``, one ``PendingRun`` (their token ids one read-only array over ``data``, which
        the caller made for this row alone: it keeps nothing else alive). ``known``: the hashes of the first
        blocks, computed by the row's register (PromptHashes); the others are hashed in one ``chain_encoded``."""
        bs, first = self.block_size, chain.num_sealed
        num = len(data) // (bs * 4)
        hashes = list(known[:num])
        if len(hashes) < num:
            k = len(hashes)
            hashes += chain_encoded(data[k * bs * 4 :] if k else data, bs, chain.salt,
                                    hashes[-1] if hashes else chain.sealed_hash, chain.extra,
                                    max(0, chain.num_public - first - k))
        chain.pending = tuple.__new__(PendingRun, (hashes, np.frombuffer(data, dtype=U32).reshape(num, bs), 0,
                                                   chain.sealed_hash, chain.salt, chain.extra,
                                                   min(num, max(0, chain.num_public - first))))
        self.has_pending[row] = True
        self.num_pending += 1

    def _reserve(self, num_rows: int) -> None:
        """Make ``partial`` and ``fill`` hold ``num_rows`` rows at least: double them (max_rows at most)."""
        old = new = self.fill.size
        if num_rows <= old:
            return
        while new < num_rows:
            new *= 2
        new = min(new, self.max_rows)
        partial, fill = np.zeros((new, self.block_size), dtype=np.uint32), np.zeros(new, dtype=np.intp)
        pending_tokens = np.zeros((new, self.block_size), dtype=np.uint32)
        partial[:old], fill[:old], pending_tokens[:old] = self.partial, self.fill, self.pending_tokens
        self.partial, self.fill, self.pending_tokens = partial, fill, pending_tokens

    def check_invariants(self, num_tokens: np.ndarray, live_rows: np.ndarray) -> None:
        """The class docstring's invariants, given the tables' token counts and the rows in use."""
        if set(np.flatnonzero(self.tracked).tolist()) != set(self.chains):
            raise InvariantViolationError("TokenChains.tracked does not mark exactly the tracked rows")
        untracked = np.flatnonzero(~self.tracked)
        if self.has_pending[untracked].any() or self.fill[untracked[untracked < self.fill.size]].any():
            raise InvariantViolationError("an untracked row has pending blocks or partial tokens")
        live, bs = set(live_rows.tolist()), self.block_size
        self.prompts.check_invariants(self.chains)
        for row, chain in self.chains.items():
            n = num_tokens.item(row)
            if row not in live or chain.num_hashes != n // bs or self.fill.item(row) != n % bs:
                raise InvariantViolationError(f"row {row}'s token chain disagrees with its {n} tokens")
            if self.has_pending.item(row) != bool(chain.pending):
                raise InvariantViolationError(f"row {row}'s has_pending disagrees with its chain")
            run = chain.pending
            if isinstance(run, PendingRun) and not (run.tokens.dtype == U32 and run.tokens.ndim == 2 and run.tokens.shape[1] == bs and
                            0 <= run.at <= run.tokens.shape[0] - len(run) and
                            run.num_public == min(len(run), max(0, chain.num_public - chain.num_sealed))):
                raise InvariantViolationError(f"row {row}'s pending run's token rows or public count are off")
            if isinstance(run, FilledBlock) and (run.at != row or len(run.hashes) != 1 or
                                                 not np.array_equal(run.tokens[row], self.pending_tokens[row])):
                raise InvariantViolationError(f"row {row}'s filled block is not its pending_tokens row")
            if isinstance(run, PendingRun) and not isinstance(run, FilledBlock) and (
                    run.at != 0 or run.tokens.shape[0] != len(run.hashes)):
                raise InvariantViolationError(f"row {row}'s pending run does not own exactly its token rows")
            parent = chain.sealed_hash
            blocks = [run.block(k) for k in range(len(run.hashes))] if isinstance(run, PendingRun) else []
            for k, entry in enumerate(blocks):
                i = chain.num_sealed + k
                salt = PUBLIC_SALT if i < chain.num_public else chain.salt
                if entry.parent_hash != parent or entry.salt != salt or entry.extra != chain.extra or \
                        entry.token_ids.size != bs or \
                        hash_encoded(parent, chain.header_of(i), entry.token_ids.astype(U32).tobytes()) != entry.block_hash:
                    raise InvariantViolationError(f"row {row}'s pending block {i} disagrees with its chain")
                parent = entry.block_hash
            if chain.header != block_header(chain.salt, chain.extra, bs) or (
                    chain.num_public and chain.public_header != block_header(PUBLIC_SALT, chain.extra, bs)):
                raise InvariantViolationError(f"row {row}'s block headers disagree with its salt and extra key")
        if np.count_nonzero(self.has_pending) != self.num_pending:
            raise InvariantViolationError("TokenChains.num_pending does not count the rows marked in has_pending")
