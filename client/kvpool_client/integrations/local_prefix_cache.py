"""The in-process baseline's prefix cache (``LocalBlockCache``'s): kvpool's (docs/prefix-caching.md) for one
process and one tenant, so that a comparison of the two engine variants is like for like.

    the same hash        ``kvpool.block_hash.chain_hashes`` (the server's core hashes with it too), salt empty
    the same sealing     a full block is matchable only from its sequence's next append (its KV is written by then)
    the same match       a prompt's longest run of cached full blocks, at most (len - 1) // block_size of them
    the same eviction    cached blocks nobody holds on an LRU (a sequence's parked tail first), taken when the free
                         list is empty; an evicted block's hash is forgotten

Bounded: one index entry per pool block at most; a tracked sequence keeps its hashes (32 B a full block) and the
token ids of its partly filled last block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpool.block_hash import NONE_HASH, chain_hashes


@dataclass
class LocalChain:
    """A tracked sequence's hashes: ``hashes[i]`` of its full block i, the first ``num_sealed`` matchable."""

    extra: bytes
    hashes: list[bytes] = field(default_factory=list)
    num_sealed: int = 0
    partial: list[int] = field(default_factory=list)  # token ids of the partly filled last block


class LocalPrefixCache:
    """Hash -> block of sealed full blocks, and the LRU of those no sequence holds.

    Invariant (``check_invariants``): ``block_of_hash`` and ``hash_of_block`` are inverse maps; ``evictable`` holds
    exactly the cached blocks of ref count 0; a tracked sequence of n tokens has ``n // block_size`` hashes and
    ``n % block_size`` partial token ids."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.block_of_hash: dict[bytes, int] = {}
        self.hash_of_block: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.chains: dict[int, LocalChain] = {}
        self.query_tokens = 0
        self.hit_tokens = 0

    # --- register ------------------------------------------------------------------------------------------------

    def match(self, prompt: np.ndarray, extra: bytes) -> tuple[list[int], list[bytes]]:
        """The blocks and hashes of ``prompt``'s longest cached run (one token is always left to compute)."""
        bs = self.block_size
        hashes = chain_hashes(prompt[: max(0, (prompt.size - 1) // bs) * bs], bs, b"", extra=extra)
        blocks: list[int] = []
        for h in hashes:
            block = self.block_of_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        self.query_tokens += int(prompt.size)
        self.hit_tokens += len(blocks) * bs
        return blocks, hashes[: len(blocks)]

    def start(self, seq: int, extra: bytes, hashes: list[bytes]) -> None:
        self.chains[seq] = LocalChain(extra, list(hashes), len(hashes))

    def fork(self, parent: int, children: Sequence[int]) -> None:
        chain = self.chains.get(parent)
        if chain is not None:  # the children share the parent's unsealed blocks: whoever appends first seals them
            for child in children:
                self.chains[child] = LocalChain(chain.extra, list(chain.hashes), chain.num_sealed,
                                                list(chain.partial))

    def drop(self, seq: int) -> None:
        self.chains.pop(seq, None)

    # --- append --------------------------------------------------------------------------------------------------

    def after_append(self, seq: int, table: list[int], length_before: int, token_ids: np.ndarray | None,
                     extra: bytes) -> None:
        """``seq`` (``table`` its blocks now) grew by an append: seal its pending blocks (this append is its next
        call), then extend its chain by ``token_ids``; without token ids it stops being tracked. An empty sequence
        starts being tracked at an append with token ids."""
        chain = self.chains.get(seq)
        if chain is None:
            if token_ids is None or length_before:
                return
            chain = self.chains[seq] = LocalChain(extra)
        for i in range(chain.num_sealed, len(chain.hashes)):
            if chain.hashes[i] not in self.block_of_hash and table[i] not in self.hash_of_block:
                self.block_of_hash[chain.hashes[i]] = table[i]
                self.hash_of_block[table[i]] = chain.hashes[i]
        chain.num_sealed = len(chain.hashes)
        if token_ids is None:
            del self.chains[seq]
            return
        tokens = chain.partial + token_ids.tolist()
        full = len(tokens) - len(tokens) % self.block_size
        parent = chain.hashes[-1] if chain.hashes else NONE_HASH
        chain.hashes += chain_hashes(tokens[:full], self.block_size, b"", parent_hash=parent, extra=chain.extra)
        chain.partial = tokens[full:]

    # --- blocks nobody holds -------------------------------------------------------------------------------------

    def park(self, block: int) -> bool:
        """A block's ref count reached 0: keep it (True) if it is cached, most recently used last."""
        if block in self.hash_of_block:
            self.evictable[block] = None
            return True
        return False

    def revive(self, block: int) -> None:
        """A parked block adopted by a register."""
        self.evictable.pop(block, None)

    def evict(self) -> int:
        """The least recently used parked block, its hash forgotten."""
        block, _ = self.evictable.popitem(last=False)
        del self.block_of_hash[self.hash_of_block.pop(block)]
        return block

    def check_invariants(self, ref: np.ndarray, lens: dict[int, int]) -> None:
        assert all(self.hash_of_block.get(b) == h for h, b in self.block_of_hash.items())
        assert len(self.hash_of_block) == len(self.block_of_hash)
        assert set(self.evictable) == {b for b in self.hash_of_block if ref[b] == 0}
        for seq, chain in self.chains.items():
            assert len(chain.hashes) == lens[seq] // self.block_size, f"sequence {seq}: hashes and length"
            assert len(chain.partial) == lens[seq] % self.block_size
