"""The fair baseline's control path: a block allocator in the engine's own process, over an in-process cache tensor
of the pool's shape, with the same calls as ``KVPoolClient`` (register / append / fork / free).

    kvpool variant:      engine --gRPC--> kvpool server (allocator, copy-on-write)  + the attached pool
    in-process variant:  engine --call--> LocalBlockCache (allocator, copy-on-write) + torch.zeros(pool shape)

The same engine, kernels and layout run on both; only where the blocks are allocated (and the cache's memory)
differ, so the difference of their step times is kvpool's cost. Copy-on-write: appending to a shared block first
copies it (one indexed copy on the device, on the current stream, before the step's writes), as the server does.
Blocks are not cleared when reused (one process: nothing leaks across tenants).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch


class LocalAppend(NamedTuple):
    slot_mapping: np.ndarray  # int64, grouped by sequence in request order


class LocalBlockCache:
    """Blocks of ``blocks`` ([num_blocks, L, 2, block_size, H, D]) handed to sequences, ref-counted.

    Invariant (``check_invariants``): a block's ref count is the number of live sequences whose table holds it;
    a block is on the free list iff its count is 0; every sequence holds ``ceil(len / block_size)`` blocks."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks
        self.block_size = blocks.shape[3]
        self.ref = np.zeros(blocks.shape[0], dtype=np.int32)
        self._free = list(range(blocks.shape[0] - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self._next_id = 1

    def register(self) -> int:
        seq, self._next_id = self._next_id, self._next_id + 1
        self.tables[seq], self.lens[seq] = [], 0
        return seq

    def _take(self) -> int:
        if not self._free:
            raise MemoryError("the in-process cache is out of blocks")
        block = self._free.pop()
        self.ref[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self._free.append(block)

    def append(self, seq_ids: int | Sequence[int], num_tokens: int | Sequence[int] = 1) -> LocalAppend:
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        counts = [num_tokens] * len(ids) if isinstance(num_tokens, int) else list(num_tokens)
        bs = self.block_size
        need = 0  # all or nothing: count the blocks first
        for seq, n in zip(ids, counts):
            table, length = self.tables[seq], self.lens[seq]
            need += -(-(length + n) // bs) - len(table)
            if length % bs and self.ref[table[-1]] > 1:
                need += 1
        if need > len(self._free):
            raise MemoryError(f"the in-process cache needs {need} blocks, {len(self._free)} are free")
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        for seq, n in zip(ids, counts):
            table, length = self.tables[seq], self.lens[seq]
            if length % bs and self.ref[table[-1]] > 1:  # copy-on-write of the shared, partly filled last block
                src, dst = table[-1], self._take()
                self._drop(src)
                table[-1] = dst
                copies.append((src, dst))
            for pos in range(length, length + n):
                if pos // bs == len(table):
                    table.append(self._take())
                slots.append(table[pos // bs] * bs + pos % bs)
            self.lens[seq] = length + n
        if copies:
            src, dst = (torch.tensor(c, device=self.blocks.device) for c in zip(*copies))
            self.blocks[dst] = self.blocks[src]
        return LocalAppend(np.asarray(slots, dtype=np.int64))

    def fork(self, parent: int, num_children: int) -> list[int]:
        children = []
        for _ in range(num_children):
            child = self.register()
            self.tables[child], self.lens[child] = list(self.tables[parent]), self.lens[parent]
            for block in self.tables[child]:
                self.ref[block] += 1
            children.append(child)
        return children

    def free(self, seq_ids: Sequence[int]) -> int:
        before = len(self._free)
        for seq in seq_ids:
            for block in self.tables.pop(seq):
                self._drop(block)
            del self.lens[seq]
        return len(self._free) - before

    def num_blocks_used(self) -> int:
        return self.blocks.shape[0] - len(self._free)

    def check_invariants(self) -> None:
        held = np.zeros_like(self.ref)
        for seq, table in self.tables.items():
            assert len(table) == -(-self.lens[seq] // self.block_size)
            np.add.at(held, table, 1)
        assert np.array_equal(held, self.ref)
        assert sorted(self._free) == np.flatnonzero(self.ref == 0).tolist()


def zeros_like_pool(layout: Any, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    """An in-process cache of the pool's logical shape and dtype (block-major, contiguous)."""
    from kvpool_client.kernels.torch_views import torch_dtype  # noqa: PLC0415

    return torch.zeros(layout.block_shape(num_blocks), dtype=torch_dtype(layout), device=device)
