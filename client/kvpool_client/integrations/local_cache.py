"""The fair baseline's control path: a block allocator in the engine's own process, over an in-process cache tensor
of the pool's shape, with the same calls as ``KVPoolClient`` (register / append / fork / free).

    kvpool variant:      engine --gRPC--> kvpool server (allocator, copy-on-write)  + the attached pool
    in-process variant:  engine --call--> LocalBlockCache (allocator, copy-on-write) + torch.zeros(pool shape)

The same engine, kernels and layout run on both; only where the blocks are allocated (and the cache's memory)
differ, so the difference of their step times is kvpool's cost. Copy-on-write: appending to a shared block first
copies it (one indexed copy on the device, on the current stream, before the step's writes), as the server does.
Blocks are not cleared when reused (one process: nothing leaks across tenants).

Prefix caching as the server does it (``LocalPrefixCache``: the same hash, sealing and match): ``register_prompt``
starts a sequence with its prompt's longest cached run, ``append(..., token_ids=...)`` tracks it, ``block_table``
names its blocks; cached blocks nobody holds are evicted only when the free list is empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvpool_client.integrations.local_prefix_cache import LocalPrefixCache
from kvpool_client.types import BlockTable, RegisteredSequence


class LocalAppend(NamedTuple):
    slot_mapping: np.ndarray  # int64, grouped by sequence in request order


class LocalBlockCache:
    """Blocks of ``blocks`` ([num_blocks, L, 2, block_size, H, D]) handed to sequences, ref-counted.

    Invariant (``check_invariants``): a block's ref count is the number of live sequences whose table holds it;
    a block is on the free list iff its count is 0 and it is not cached (``prefix.evictable`` holds the cached
    ones); every sequence holds ``ceil(len / block_size)`` blocks."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks
        self.block_size = blocks.shape[3]
        self.ref = np.zeros(blocks.shape[0], dtype=np.int32)
        self._free = list(range(blocks.shape[0] - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.extra: dict[int, bytes] = {}  # a sequence's cache_extra_key, where it has one
        self.prefix = LocalPrefixCache(self.block_size)
        self._next_id = 1

    def register(self, seq_id: int | None = None, *, cache_extra_key: bytes = b"") -> int:
        seq, self._next_id = self._next_id, self._next_id + 1
        self.tables[seq], self.lens[seq] = [], 0
        if cache_extra_key:
            self.extra[seq] = cache_extra_key
        return seq

    def register_prompt(self, prompt_token_ids: Sequence[int] | np.ndarray, seq_id: int | None = None, *,
                        public_prefix_len: int = 0, cache_extra_key: bytes = b"") -> tuple[int, int]:
        """A sequence that starts with the prompt's longest cached run; (seq, num_cached_tokens), as the server."""
        prompt = np.asarray(prompt_token_ids, dtype=np.uint32)
        blocks, hashes = self.prefix.match(prompt, cache_extra_key)
        seq = self.register(cache_extra_key=cache_extra_key)
        for block in blocks:
            if self.ref[block] == 0:
                self.prefix.revive(block)
            self.ref[block] += 1
        self.tables[seq], self.lens[seq] = blocks, len(blocks) * self.block_size
        self.prefix.start(seq, cache_extra_key, hashes)
        return seq, self.lens[seq]

    def register_prompts(self, prompts: Sequence[Sequence[int] | np.ndarray], *,
                         cache_extra_keys: Sequence[bytes] = ()) -> list[RegisteredSequence]:
        """``register_prompt`` for each prompt, with its cached blocks, as the server's RegisterSequences."""
        keys = list(cache_extra_keys) or [b""] * len(prompts)
        found = [self.register_prompt(p, cache_extra_key=k) for p, k in zip(prompts, keys)]
        return [RegisteredSequence(seq, n, np.asarray(self.tables[seq], dtype=np.int32)) for seq, n in found]

    def block_table(self, seq_id: int) -> BlockTable:
        return BlockTable(np.asarray(self.tables[seq_id], dtype=np.int64), self.lens[seq_id], self.block_size)

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self.prefix.evictable:
            block = self.prefix.evict()
        else:
            raise MemoryError("the in-process cache is out of blocks")
        self.ref[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0 and not self.prefix.park(block):
            self._free.append(block)

    def append(self, seq_ids: int | Sequence[int], num_tokens: int | Sequence[int] = 1, *,
               token_ids: Sequence[int] | np.ndarray | None = None) -> LocalAppend:
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        counts = [num_tokens] * len(ids) if isinstance(num_tokens, int) else list(num_tokens)
        tokens = None if token_ids is None else np.asarray(token_ids, dtype=np.uint32)
        if tokens is not None and tokens.size != sum(counts):
            raise ValueError(f"{tokens.size} token ids for {sum(counts)} appended tokens")
        bs = self.block_size
        need = 0  # all or nothing: count the blocks first
        for seq, n in zip(ids, counts):
            table, length = self.tables[seq], self.lens[seq]
            need += -(-(length + n) // bs) - len(table)
            if length % bs and self.ref[table[-1]] > 1:
                need += 1
        if need > len(self._free) + len(self.prefix.evictable):
            raise MemoryError(f"the in-process cache needs {need} blocks, "
                              f"{len(self._free) + len(self.prefix.evictable)} are free or evictable")
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        starts = np.cumsum(counts) - counts
        for seq, n, at in zip(ids, counts, starts.tolist()):
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
            self.prefix.after_append(seq, table, length, None if tokens is None else tokens[at:at + n],
                                     self.extra.get(seq, b""))
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
            if parent in self.extra:
                self.extra[child] = self.extra[parent]
            children.append(child)
        self.prefix.fork(parent, children)
        return children

    def free(self, seq_ids: Sequence[int]) -> int:
        before = len(self._free)
        for seq in seq_ids:
            for block in reversed(self.tables.pop(seq)):  # the tail parked first: evicted before what it extends
                self._drop(block)
            del self.lens[seq]
            self.extra.pop(seq, None)
            self.prefix.drop(seq)
        return len(self._free) - before

    def num_blocks_used(self) -> int:
        return self.blocks.shape[0] - len(self._free) - len(self.prefix.evictable)

    def check_invariants(self) -> None:
        held = np.zeros_like(self.ref)
        for seq, table in self.tables.items():
            assert len(table) == -(-self.lens[seq] // self.block_size)
            np.add.at(held, table, 1)
        assert np.array_equal(held, self.ref)
        assert sorted(self._free) == sorted(set(np.flatnonzero(self.ref == 0).tolist()) - set(self.prefix.evictable))
        self.prefix.check_invariants(self.ref, self.lens)


def zeros_like_pool(layout: Any, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    """An in-process cache of the pool's logical shape and dtype (block-major, contiguous)."""
    from kvpool_client.kernels.torch_views import torch_dtype  # noqa: PLC0415

    return torch.zeros(layout.block_shape(num_blocks), dtype=torch_dtype(layout), device=device)
