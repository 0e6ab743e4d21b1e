"""KVCacheManager: sequences, atomic batched append, copy-on-write fork and free, over one BlockAllocator."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool_server.core.allocator import BlockAllocator
from kvpool_server.core.append import plan_append_general, plan_append_one_each
from kvpool_server.core.block_tables import BlockTables
from kvpool_server.core.errors import FailedPreconditionError, InvalidArgumentError, SequenceExistsError
from kvpool_server.core.invariants import check_manager_invariants, compute_stats
from kvpool_server.core.seq_index import SequenceIndex, check_caller_seq_id
from kvpool_server.core.types import EMPTY_BLOCKS, NO_COPIES, AppendPlan, PoolStats, TokenAddress


class KVCacheManager:
    """Page tables over a pool of ``num_blocks`` blocks of ``block_size`` tokens, with copy-on-write sharing.

    The manager plans; the device layer executes. ``append`` returns an AppendPlan whose ``copies`` the caller
    must run on the pool (``pool.copy_blocks(plan.copies)``) before writing into the new slots.

    Fork shares blocks; the first write into a shared block (the partly filled last block included) copies it::

        parent  [A|B|C.]        fork        parent [A|B|C.]   append   parent [A|B|C*]  (writes C in place)
                                  ->        child  [A|B|C.]     ->     child  [A|B|C'*] (C copied to C' first)
                                            ref A=B=C=2                ref A=B=2, C=1, C'=1

    Every operation checks everything before it changes anything: an operation that raises leaves the manager
    exactly as it was. A batch that cannot be served in full is not served in part.

    Invariants (``check_invariants``):
      - every block's ref count equals the number of (live sequence, logical block) entries naming it;
      - a sequence with n tokens holds exactly ceil(n / block_size) blocks, no block twice;
      - all sequences that share a block agree on how many of its slots hold tokens;
      - the allocator's (free list iff ref count 0), the index's and the tables' own invariants.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_seq_len: int | None = None,
        max_num_seqs: int = 4096,
    ) -> None:
        if block_size < 1:
            raise InvalidArgumentError(f"block_size must be >= 1, got {block_size}")
        self.block_size: int = block_size
        self.num_blocks: int = num_blocks
        self.max_seq_len: int = max_seq_len if max_seq_len is not None else min(num_blocks * block_size, 1 << 15)
        if self.max_seq_len < 1:
            raise InvalidArgumentError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        self.index: SequenceIndex = SequenceIndex(max_num_seqs)  # checks max_num_seqs
        self.allocator: BlockAllocator = BlockAllocator(num_blocks)
        self.tables: BlockTables = BlockTables(block_size, self.max_seq_len, max_num_seqs)
        self.num_copies: int = 0
        # block_size as a 0-d int64 array: block ids (int32) times it give int64 slots without a cast.
        self.block_size_array: np.ndarray = np.array(block_size, dtype=np.int64)
        # Scratch for the duplicate-id check of a batch (stamp[row] = position in the batch), made once.
        self._stamp: np.ndarray = np.zeros(self.index.row_to_id.size, dtype=np.int64)
        self._arange: np.ndarray = np.arange(min(max_num_seqs, 1 << 16), dtype=np.int64)

    # ---------------------------------------------------------------- sequences
    @property
    def num_sequences(self) -> int:
        return len(self.index)

    def register(self, seq_id: int | None = None) -> int:
        """Create an empty sequence; the manager assigns the id unless one is given."""
        if seq_id is not None:
            if seq_id in self.index:
                raise SequenceExistsError(f"sequence {seq_id} already exists")
            check_caller_seq_id(seq_id)
        row = self.tables.acquire_row()
        if seq_id is None:
            seq_id = self.index.new_server_id(row)
        self.index.add(seq_id, row)
        return seq_id

    def fork(self, parent_seq_id: int, num_children: int = 0, child_seq_ids: Sequence[int] = ()) -> list[int]:
        """Make children that share every block of the parent (ref counts go up, nothing is copied)."""
        parent_row = self.index.row(parent_seq_id)
        child_seq_ids = list(child_seq_ids)
        if child_seq_ids:
            if num_children not in (0, len(child_seq_ids)):
                raise InvalidArgumentError(
                    f"num_children={num_children} but {len(child_seq_ids)} child_seq_ids were given"
                )
            for seq_id in child_seq_ids:
                if seq_id in self.index:
                    raise SequenceExistsError(f"sequence {seq_id} already exists")
                check_caller_seq_id(seq_id)
            if len(set(child_seq_ids)) != len(child_seq_ids):
                raise InvalidArgumentError("child_seq_ids repeat an id")
            num_children = len(child_seq_ids)
        elif num_children < 1:
            raise InvalidArgumentError(f"num_children must be >= 1, got {num_children}")
        rows = self.tables.acquire_rows(num_children)
        if not child_seq_ids:
            child_seq_ids = [self.index.new_server_id(row) for row in rows]
        num_tokens = int(self.tables.num_tokens[parent_row])
        num_blocks = -(-num_tokens // self.block_size)
        blocks = self.tables.table[parent_row, :num_blocks]
        self.tables.table[rows, :num_blocks] = blocks
        self.tables.num_tokens[rows] = num_tokens
        self.tables.next_slot[rows] = self.tables.next_slot[parent_row]
        self.allocator.incref(blocks, num_children)  # a sequence never holds a block twice
        for seq_id, row in zip(child_seq_ids, rows):
            self.index.add(seq_id, row)
        return child_seq_ids

    def free(self, seq_ids: int | Sequence[int]) -> int:
        """Release sequences, all or none; blocks whose ref count reaches 0 are reusable at once.

        Returns the number of blocks freed.
        """
        tables, bs = self.tables, self.block_size
        ids = [seq_ids] if isinstance(seq_ids, int) else [int(s) for s in seq_ids]
        if not ids:
            raise InvalidArgumentError("free needs at least one seq_id")
        rows = [self.index.row(seq_id) for seq_id in ids]
        if len(rows) > 1 and len(set(rows)) != len(rows):
            raise InvalidArgumentError("free names a sequence twice")
        table, num_tokens = tables.table, tables.num_tokens
        held = [table[row, : -(-num_tokens.item(row) // bs)] for row in rows]
        num_freed = self.allocator.decref(held[0] if len(held) == 1 else np.concatenate(held))
        for seq_id, row in zip(ids, rows):
            tables.release_row(row)
            self.index.remove(seq_id)
        return num_freed

    # ---------------------------------------------------------------- append
    def append(self, seq_id: int, num_tokens: int = 1) -> AppendPlan:
        """Append tokens to one sequence (the per-sequence path)."""
        row = self.index.row(seq_id)
        tables, allocator = self.tables, self.allocator
        length = tables.num_tokens.item(row)
        block_index, offset = divmod(length, self.block_size)
        if offset and allocator.num_shared_blocks and allocator.ref_count[tables.table[row, block_index]] > 1:
            return self.append_rows(np.array([row]), num_tokens)  # copy-on-write first
        return self._append_unshared(seq_id, row, length, num_tokens)

    def _append_unshared(self, seq_id: int, row: int, length: int, num_tokens: int) -> AppendPlan:
        """Tokens to one sequence whose last block is its own (no copy-on-write): a decode token, a prefill."""
        if num_tokens < 1:
            raise InvalidArgumentError(f"num_tokens must be >= 1, got {num_tokens}")
        new_length = length + num_tokens
        if new_length > self.max_seq_len:
            raise InvalidArgumentError(
                f"append would grow sequence {seq_id} to {new_length} tokens, over max_seq_len={self.max_seq_len}"
            )
        tables, bs = self.tables, self.block_size
        first_block = length // bs
        if first_block == (new_length - 1) // bs:  # every new token lands in one block: the slots are a range
            if length % bs == 0:
                block_id = self.allocator.allocate_one()  # raises before any change
                tables.table[row, first_block] = block_id
                start, new_blocks = block_id * bs, np.array([block_id], dtype=np.int32)
            else:
                start, new_blocks = tables.next_slot.item(row), EMPTY_BLOCKS
            tables.num_tokens[row] = new_length
            tables.next_slot[row] = start + num_tokens
            return AppendPlan(np.arange(start, start + num_tokens, dtype=np.int64), new_blocks, NO_COPIES)
        old_num_blocks, new_num_blocks = -(-length // bs), -(-new_length // bs)
        new_blocks = self.allocator.allocate(new_num_blocks - old_num_blocks)  # raises before any change
        table_row = tables.table[row]
        table_row[old_num_blocks:new_num_blocks] = new_blocks
        tables.num_tokens[row] = new_length
        # Slot of position p: (block of p) * bs + p % bs, through the tables' per-position lookups.
        touched = table_row[first_block:new_num_blocks] * self.block_size_array
        index = tables.block_index[length:new_length]
        slots = touched.take(index - first_block if first_block else index) + tables.offset[length:new_length]
        tables.next_slot[row] = slots.item(-1) + 1
        return AppendPlan(slots, new_blocks, NO_COPIES)

    def append_batch(self, seq_ids: Sequence[int] | np.ndarray, num_tokens: int | Sequence[int] = 1) -> AppendPlan:
        """Append ``num_tokens`` (one count for all, or one per sequence) to many sequences, atomically.

        Slots in ``plan.slot_mapping`` are grouped by sequence in the order of ``seq_ids``.
        """
        ids = np.asarray(seq_ids, dtype=np.uint64)
        if ids.ndim != 1 or ids.size == 0:
            raise InvalidArgumentError("append needs a non-empty list of seq_ids")
        rows = self.index.rows(ids)
        self._check_distinct(rows)
        return self.append_rows(rows, num_tokens)

    def append_rows(self, rows: np.ndarray, num_tokens: int | Sequence[int]) -> AppendPlan:
        """Append to already-resolved, distinct live rows (``append``, ``append_batch`` and SequenceBatch)."""
        if isinstance(num_tokens, (int, np.integer)):
            if num_tokens < 1:
                raise InvalidArgumentError(f"num_tokens must be >= 1, got {num_tokens}")
            if num_tokens == 1:
                plan = plan_append_one_each(self, rows)
                if plan is not None:
                    return plan
            counts = np.full(rows.size, num_tokens, dtype=np.int64)
        else:
            counts = np.asarray(num_tokens, dtype=np.int64)
            if counts.shape != rows.shape:
                raise InvalidArgumentError(f"{counts.size} num_tokens values for {rows.size} sequences")
            if (counts < 1).any():
                raise InvalidArgumentError(f"every num_tokens must be >= 1, got {counts.min()}")
        plan = plan_append_general(self, rows, counts)
        self.num_copies += plan.copies.shape[0]
        return plan

    def _check_distinct(self, rows: np.ndarray) -> None:
        if self._arange.size < rows.size:
            self._arange = np.arange(max(rows.size, 2 * self._arange.size), dtype=np.int64)
        order = self._arange[: rows.size]
        self._stamp[rows] = order
        if np.count_nonzero(self._stamp.take(rows) != order):
            raise InvalidArgumentError("the batch names a sequence twice")

    # ---------------------------------------------------------------- lookups
    def num_tokens(self, seq_id: int) -> int:
        return int(self.tables.num_tokens[self.index.row(seq_id)])

    def block_table(self, seq_id: int) -> np.ndarray:
        """A copy of the sequence's block ids, logical order."""
        row = self.index.row(seq_id)
        return self.tables.table[row, : -(-int(self.tables.num_tokens[row]) // self.block_size)].copy()

    def translate(self, seq_id: int, position: int) -> TokenAddress:
        """(sequence, token position) -> (block, offset, slot)."""
        slot = int(self.slots(seq_id, position, 1)[0])
        return TokenAddress(block_id=slot // self.block_size, offset=slot % self.block_size, slot=slot)

    def slots(self, seq_id: int, start: int, count: int, for_write: bool = False) -> np.ndarray:
        """Slots of tokens [start, start + count) of a sequence.

        With ``for_write``, every block touched must be this sequence's alone (ref count 1): writing into a shared
        block would change the other sequences' KV, so it raises FailedPreconditionError.
        """
        row = self.index.row(seq_id)
        length = int(self.tables.num_tokens[row])
        if start < 0 or count < 1 or start + count > length:
            raise InvalidArgumentError(
                f"tokens [{start}, {start + count}) are outside sequence {seq_id} of {length} tokens"
            )
        slots = self.tables.slots(row, np.arange(start, start + count, dtype=np.int64))
        if for_write and (self.allocator.ref_count[slots // self.block_size] > 1).any():
            raise FailedPreconditionError(
                f"tokens [{start}, {start + count}) of sequence {seq_id} lie in blocks shared with other "
                "sequences; append to the sequence (copy-on-write) before writing there"
            )
        return slots

    def stats(self) -> PoolStats:
        return compute_stats(self)

    def check_invariants(self) -> None:
        check_manager_invariants(self)
