"""BlockTables: the page table of every sequence row, and the appends planned on them."""

from __future__ import annotations

from typing import overload

import numpy as np

from kvpool_server.core.allocator import BlockAllocator
from kvpool_server.core.errors import InvalidArgumentError, OutOfBlocksError
from kvpool_server.core.length_lookups import LengthLookups
from kvpool_server.core.types import EMPTY_BLOCKS, NO_COPIES, UNLIMITED, AppendPlan

UNSET = -1
SCRATCH_BLOCKS = 1 << 13  # run_slots keeps a scratch of up to this many blocks' slots (1 MiB at block size 16)
PREALLOCATED_BYTES = 64 << 20  # a table up to this size is made whole at start (growing it stalls a call ~20 ms)
# A 0-d array, not a Python int: NumPy adds it to an array faster (no scalar conversion per call).
ONE = np.array(1, dtype=np.int64)
ONE.flags.writeable = False


class BlockTables:
    """One row per sequence: ``table[row, i]`` is the physical block of the row's logical block i.

    A row with n tokens holds ``blocks_for(n) = ceil(n / block_size)`` blocks; the token at position p lives in
    logical block ``p // block_size`` at offset ``p % block_size``, and its slot in the pool is
    ``block * block_size + offset`` (``slots()``, the one definition). Entries past a row's last block are UNSET
    (-1). Kept as arrays, a batched append reads and writes every row with a few NumPy operations (the layout vLLM's
    InputBatch uses for its block table)::

        row 3:  [ 17 | 4 | 9 | -1 | -1 ...]   num_tokens[3] = 37, next_slot[3] = 9 * 16 + 5, block_size 16
                  0-15 16-31 32-36 (11 free slots in block 9)

    ``next_slot[row]`` caches the slot of the row's next token while its last block has room, so that the tuned
    paths read one number per row instead of recomputing it from the table (a new block's first slot is
    ``block * block_size``; tokens inside one block have consecutive slots).

    The tables own the references to blocks: they alone call the allocator (allocate, incref, decref). Appends are
    planned here (``plan_append``) and change nothing when they raise. Copy-on-write: a row whose next token lands
    in a partly filled block that others share (``_writes_into_shared``, the one test) copies that block to a new
    one first, returned in the plan as a (src, dst) pair for the device layer to run. Within a batch the rule is
    sequential: if every sharer of a block appends, the last of them (in batch order) owns it alone by then and
    writes in place, so k sharers appending together make k - 1 copies.

    Rows are reused after a sequence is freed. The arrays hold ``max_num_seqs`` rows from the start when the table
    fits ``PREALLOCATED_BYTES`` (32 MiB at the defaults: 4,096 rows of 2,048 blocks); else they start at 64 rows and
    at least double when they run out (the call that makes them grow pays for the copy, once per size).

    Invariants (checked by ``checks.check_block_tables``):
      - a row holds at most ``max_seq_len`` tokens;
      - a row with n tokens holds exactly ``blocks_for(n)`` valid block ids, no block twice, and UNSET after them;
      - a row with n tokens, ``n % block_size != 0``, has ``next_slot == slots(row, n)``;
      - a free row holds no tokens, no blocks and ``next_slot == 0``; the free list names each row once;
      - every block's ref count equals the number of table entries (of rows in use) naming it;
      - rows that share a block agree on how many of its slots hold tokens;
      - ``num_copies`` (copy-on-write copies planned so far) and ``num_tokens_appended`` (slots handed out by appends
        so far) are not negative;
      - the allocator's own invariants.
    """

    def __init__(
        self, block_size: int, max_seq_len: int, max_num_seqs: int, allocator: BlockAllocator,
        initial_rows: int | None = None,
    ) -> None:
        self.block_size: int = block_size
        self.max_seq_len: int = max_seq_len
        self.max_num_seqs: int = max_num_seqs
        self.max_blocks_per_seq: int = self.blocks_for(max_seq_len)
        if initial_rows is None:  # every row at once when they fit PREALLOCATED_BYTES: no call pays for a growth
            whole = max_num_seqs * self.max_blocks_per_seq * 4 <= PREALLOCATED_BYTES
            initial_rows = max_num_seqs if whole else 64
        rows = min(initial_rows, max_num_seqs)
        self.allocator: BlockAllocator = allocator
        self.table: np.ndarray = np.full((rows, self.max_blocks_per_seq), UNSET, dtype=np.int32)
        self.num_tokens: np.ndarray = np.zeros(rows, dtype=np.int64)
        self.next_slot: np.ndarray = np.zeros(rows, dtype=np.int64)
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))
        self.num_copies: int = 0
        self.num_tokens_appended: int = 0
        self.by_length: LengthLookups = LengthLookups(self.max_seq_len, self.block_size)  # derived from the shape above, read-only
        self._offsets: np.ndarray = np.arange(block_size, dtype=np.int64)  # a block's slots, from its first (run_slots)
        self._expanded: np.ndarray = np.empty((64, block_size), dtype=np.int64)  # run_slots' scratch (SCRATCH_BLOCKS)

    @overload
    def blocks_for(self, num_tokens: int) -> int: ...

    @overload
    def blocks_for(self, num_tokens: np.ndarray) -> np.ndarray: ...

    def blocks_for(self, num_tokens: int | np.ndarray) -> int | np.ndarray:
        """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size), for an int or an array."""
        return -(-num_tokens // self.block_size)

    def slots(self, rows: np.ndarray | int, positions: np.ndarray | slice) -> np.ndarray:
        """The slot (int64) of token ``positions[i]`` of row ``rows[i]`` (two arrays), or of the tokens
        ``positions`` (an array or a slice) of one row (an int): ``table[row, p // block_size] * block_size +
        p % block_size``. The positions must lie in blocks the rows hold."""
        lookup = self.by_length
        index = lookup.block_index[positions]
        blocks = self.table[rows].take(index) if rows.__class__ is int else self.table[rows, index]
        return blocks * lookup.block_size + lookup.offset[positions]

    def run_slots(self, rows: np.ndarray, lengths: np.ndarray, new_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``slots()`` of the tokens [lengths[i], new_lengths[i]) of each row ``rows[i]`` (runs of at least one
        token, in blocks the rows hold), concatenated in that order, and each row's next slot (its last slot + 1).
        Per block, not per token: every block a run touches is expanded whole (``block * block_size +
        arange(block_size)``, into a scratch array kept across calls), then the slots before each run's first token
        and past its last are trimmed off."""
        lookup, bs = self.by_length, self.block_size
        first = lookup.block_index.take(lengths)
        touched = lookup.num_blocks.take(new_lengths) - first  # >= 1 each
        starts = np.cumsum(touched) - touched  # each row's first block among the touched
        num = starts.item(-1) + touched.item(-1)
        blocks = self.table[np.repeat(rows, touched), np.repeat(first - starts, touched) + np.arange(num)]
        if self._expanded.shape[0] < num <= SCRATCH_BLOCKS:  # kept: a fresh array each call costs its page faults
            self._expanded = np.empty((min(max(num, 2 * self._expanded.shape[0]), SCRATCH_BLOCKS), bs), dtype=np.int64)
        scratch = self._expanded[:num] if num <= SCRATCH_BLOCKS else np.empty((num, bs), dtype=np.int64)
        np.multiply(blocks[:, None], lookup.block_size, out=scratch)
        scratch += self._offsets
        expanded = scratch.reshape(-1)
        head, last = lookup.offset.take(lengths), starts + touched - ONE
        tail = lookup.offset.take(new_lengths - ONE) + ONE  # slots used in each run's last block
        next_slots = blocks.take(last) * lookup.block_size + tail
        if np.count_nonzero(head) or np.count_nonzero(tail != bs):
            keep = np.ones((num, bs), dtype=bool)
            keep[starts] = self._offsets >= head[:, None]
            keep[last] &= self._offsets < tail[:, None]
            return expanded[keep.reshape(-1)], next_slots
        return expanded.copy(), next_slots

    # ---------------------------------------------------------------- rows
    @property
    def num_rows(self) -> int:
        return self.table.shape[0]

    def num_live_rows(self) -> int:
        return self.num_rows - len(self._free_rows)

    def acquire_rows(self, num: int) -> list[int]:
        if self.num_live_rows() + num > self.max_num_seqs:
            raise OutOfBlocksError(
                f"{num} more sequences would exceed max_num_seqs={self.max_num_seqs} ({self.num_live_rows()} are live)"
            )
        if len(self._free_rows) < num:
            self._grow(self.num_live_rows() + num)
        rows = self._free_rows[: -num - 1 : -1] if num else []  # popped from the end, one after the other
        del self._free_rows[len(self._free_rows) - num :]
        return rows

    def acquire_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        return self.acquire_rows(1)[0]

    def fork(self, parent_row: int, child_rows: list[int]) -> None:
        """Give each child row the parent's tokens, sharing its blocks: ref counts go up, nothing is copied."""
        num_tokens = self.num_tokens.item(parent_row)
        blocks = self.table[parent_row, : self.blocks_for(num_tokens)]
        self.table[child_rows, : blocks.size] = blocks
        self.num_tokens[child_rows] = num_tokens
        self.next_slot[child_rows] = self.next_slot[parent_row]
        self.allocator.incref(blocks, len(child_rows))  # a row never holds a block twice

    def blocks_of(self, row: int) -> np.ndarray:
        """The row's block ids, logical order: a view of its table row."""
        return self.table[row, : self.blocks_for(self.num_tokens.item(row))]

    def adopt(self, row: int, block_ids: np.ndarray) -> int:
        """Give the empty ``row`` the full cached ``block_ids`` (a prefix match), one more reference each. Returns
        how many of them were revived from the evictable LRU."""
        self.table[row, : block_ids.size] = block_ids
        self.num_tokens[row] = block_ids.size * self.block_size
        return self.allocator.reuse(block_ids)

    def release(self, rows: list[int]) -> int:
        """Drop the distinct ``rows``' references to their blocks and put the rows back on the free list.

        Returns how many blocks were freed (their ref count reached 0). Many rows: their blocks are gathered from
        the rectangle of their first ``width`` entries (the longest row's blocks) with one mask -- a row's entries
        past its blocks are UNSET -- unless that rectangle is mostly UNSET (one long row among short ones: a slice
        per row); only that rectangle is reset (the entries past it are UNSET already).
        """
        table, num_tokens, num_blocks = self.table, self.num_tokens, self.by_length.num_blocks
        if len(rows) == 1:
            row = rows[0]
            width = num_blocks.item(num_tokens.item(row))
            num_freed = self.allocator.decref(table[row, :width])
            table[row, :width] = UNSET
            num_tokens[row] = 0
            self.next_slot[row] = 0
        else:  # one scatter per array (a free of thousands of forks)
            counts = num_blocks.take(num_tokens.take(rows))
            width = counts.max()
            if len(rows) * width > 2 * counts.sum() + 64:
                held = np.concatenate([table[row, :count] for row, count in zip(rows, counts.tolist())])
            else:
                rectangle = table[rows, :width]
                held = rectangle[rectangle != UNSET]
            num_freed = self.allocator.decref(held)
            table[rows, :width] = UNSET
            num_tokens[rows] = 0
            self.next_slot[rows] = 0
        self._free_rows.extend(rows)
        return num_freed

    def free_rows(self) -> list[int]:
        return list(self._free_rows)

    def rows_in_use(self) -> np.ndarray:
        return np.setdiff1d(np.arange(self.num_rows), self._free_rows)

    def _grow(self, needed: int) -> None:
        """Double the rows until ``needed`` fit (``max_num_seqs`` at most), in one copy."""
        old = new = self.num_rows
        while new < needed:
            new *= 2
        new = min(new, self.max_num_seqs)
        table = np.full((new, self.max_blocks_per_seq), UNSET, dtype=np.int32)
        table[:old] = self.table
        num_tokens, next_slot = np.zeros(new, dtype=np.int64), np.zeros(new, dtype=np.int64)
        num_tokens[:old], next_slot[:old] = self.num_tokens, self.next_slot
        self.table, self.num_tokens, self.next_slot = table, num_tokens, next_slot
        self._free_rows[:0] = range(new - 1, old - 1, -1)

    # ---------------------------------------------------------------- append
    def plan_append(self, rows: np.ndarray | int, num_new_tokens: int | np.ndarray, budget: int = UNLIMITED,
                    why: str = "") -> AppendPlan:
        """Append ``num_new_tokens`` (>= 1: an int for every row, or an int64 array of one per row) to ``rows``
        (distinct rows in use as an intp array, or one row as an int), all or nothing, copying on write. Slots come
        grouped by row in the order of ``rows``. At most ``budget`` blocks may be taken (a tenant's, passed down
        to the allocator with ``why``, the quota that bounds it: QuotaExceededError).

        Two shapes have tuned paths beside the general one, which they hand over to when a row must copy on write:
        one token for each of many rows (the decode step) and any tokens for one row (a prefill).
        """
        # ``__class__ is`` rather than isinstance: the cheapest test on the hot path; mypy cannot narrow it (the
        # ignores; no typing.cast, which is a call)
        if rows.__class__ is int:
            plan = self._plan_one_row(rows, num_new_tokens, budget, why)  # type: ignore[arg-type]
            if plan is None:
                plan = self._plan_general(np.array([rows]), num_new_tokens, budget, why)
        elif num_new_tokens.__class__ is int and num_new_tokens == 1:
            plan = self._plan_decode(rows, budget, why)  # type: ignore[arg-type]
            if plan is None:
                plan = self._plan_general(rows, num_new_tokens, budget, why)  # type: ignore[arg-type]
        else:
            plan = self._plan_general(rows, num_new_tokens, budget, why)  # type: ignore[arg-type]
        self.num_tokens_appended += plan.slot_mapping.shape[0]
        return plan

    def _plan_decode(self, rows: np.ndarray, budget: int, why: str) -> AppendPlan | None:
        """One token for each row, or None when a row must copy on write.

        Written for NumPy's per-call cost, which is most of a step's cost at these sizes: gathers (``take``) through
        the per-length lookups and the cached ``next_slot`` instead of arithmetic on the whole batch, and a reduction
        only where one is unavoidable (``count_nonzero``, the cheapest).
        """
        lookup, allocator = self.by_length, self.allocator
        lengths = self.num_tokens.take(rows)
        if np.count_nonzero(lookup.at_limit.take(lengths)):
            raise self._too_long(lengths + ONE)
        if allocator.num_shared_blocks and np.count_nonzero(self._writes_into_shared(rows, lengths)):
            return None
        slots = self.next_slot.take(rows)
        opening = lookup.starts_block.take(lengths).nonzero()[0]
        if opening.size:
            new_blocks = allocator.allocate(opening.size, budget, why)  # raises OutOfBlocksError before any change
            self.table[rows.take(opening), lookup.block_index.take(lengths.take(opening))] = new_blocks
            slots[opening] = new_blocks * lookup.block_size  # offset 0 of each new block
        else:
            new_blocks = EMPTY_BLOCKS
        self.next_slot[rows] = slots + ONE
        self.num_tokens[rows] = lengths + ONE
        return AppendPlan(slots, new_blocks, NO_COPIES, new_blocks)  # no copies: every new block is cleared

    def _plan_one_row(self, row: int, count: int, budget: int, why: str) -> AppendPlan | None:
        """``count`` tokens for one row, in scalars, or None when the row must copy on write. Tokens that all land in
        one block take a run of slots from the first, which is the cached next slot or offset 0 of a new block."""
        allocator, block_size = self.allocator, self.block_size
        length = self.num_tokens.item(row)
        new_length = length + count
        if new_length > self.max_seq_len:
            raise self._too_long(np.array([new_length]))
        if allocator.num_shared_blocks and self._writes_into_shared(row, length):
            return None
        first_block, first_offset = divmod(length, block_size)
        last_block = (new_length - 1) // block_size
        if first_block == last_block:  # one block
            if first_offset == 0:
                self.table[row, first_block] = block_id = allocator.allocate_one(budget, why)  # raises before any change
                first, new_blocks = block_id * block_size, np.array([block_id], dtype=np.int32)
            else:
                first, new_blocks = self.next_slot.item(row), EMPTY_BLOCKS
            next_slot = first + count
            slots = np.arange(first, next_slot, dtype=np.int64)
        else:
            held = first_block + (first_offset > 0)
            new_blocks = allocator.allocate(last_block + 1 - held, budget, why)  # raises before any change
            self.table[row, held : last_block + 1] = new_blocks
            blocks = self.table[row, first_block : last_block + 1]  # expanded whole, trimmed by a slice
            slots = (blocks[:, None] * self.by_length.block_size + self._offsets).reshape(-1)[first_offset : first_offset + count]
            next_slot = slots.item(-1) + 1
        self.num_tokens[row] = new_length
        self.next_slot[row] = next_slot
        return AppendPlan(slots, new_blocks, NO_COPIES, new_blocks)

    def _plan_general(self, rows: np.ndarray, num_new_tokens: int | np.ndarray, budget: int = UNLIMITED,
                      why: str = "") -> AppendPlan:
        """Any counts, with copy-on-write (see ``plan_append``)."""
        lookup, allocator, table = self.by_length, self.allocator, self.table
        lengths = self.num_tokens.take(rows)
        new_lengths = lengths + num_new_tokens
        if new_lengths.max() > self.max_seq_len:
            raise self._too_long(new_lengths)
        held = lookup.num_blocks.take(lengths)
        grow = lookup.num_blocks.take(new_lengths) - held
        num_copies = 0
        if allocator.num_shared_blocks:
            shared = np.flatnonzero(self._writes_into_shared(rows, lengths))
            copy_rows, copy_index = rows.take(shared), lookup.block_index.take(lengths.take(shared))
            src = table[copy_rows, copy_index]  # the partly filled blocks that may need a copy
            copiers = self._copiers(src)
            copy_rows, copy_index, src = copy_rows[copiers], copy_index[copiers], src[copiers]
            num_copies = src.size
        num_grow = int(grow.sum())
        new_blocks = allocator.allocate(num_copies + num_grow, budget, why)  # raises before any change

        # --- from here on nothing can fail ---
        copies = NO_COPIES
        if num_copies:
            dst = new_blocks[:num_copies]
            allocator.decref(src)  # frees nothing: another sharer keeps each src
            table[copy_rows, copy_index] = dst
            copies = np.stack([src, dst], axis=1)
            self.num_copies += num_copies
        if num_grow:
            before = np.cumsum(grow) - grow  # blocks the earlier rows take
            table[np.repeat(rows, grow), np.repeat(held - before, grow) + np.arange(num_grow)] = new_blocks[num_copies:]
        self.num_tokens[rows] = new_lengths
        slots, self.next_slot[rows] = self.run_slots(rows, lengths, new_lengths)
        return AppendPlan(slots, new_blocks, copies, new_blocks[num_copies:] if num_copies else new_blocks)

    def _writes_into_shared(self, rows: np.ndarray | int, lengths: np.ndarray | int) -> np.ndarray | bool:
        """The copy-on-write test: whether the next token of each row (of ``lengths`` tokens) lands in a block other
        rows also reference. At a block boundary the entry looked up is UNSET, whose (padded) ref count is 0."""
        next_block = self.table[rows, self.by_length.block_index[lengths]]
        return self.allocator.ref_count_padded[next_block] > 1

    def _copiers(self, blocks: np.ndarray) -> np.ndarray:
        """Which of the batch's rows writing into shared ``blocks`` must copy: all of them, except that for a block
        whose every sharer is in the batch, the last of them owns it alone by then and writes in place."""
        copiers = np.ones(blocks.size, dtype=bool)
        unique, counts = np.unique(blocks, return_counts=True)
        for block_id in unique[counts == self.allocator.ref_count[unique]].tolist():
            copiers[np.flatnonzero(blocks == block_id)[-1]] = False
        return copiers

    def _too_long(self, new_lengths: np.ndarray) -> InvalidArgumentError:
        worst = int(np.argmax(new_lengths))
        return InvalidArgumentError(
            f"append would grow a sequence to {int(new_lengths[worst])} tokens, over max_seq_len={self.max_seq_len}"
        )
