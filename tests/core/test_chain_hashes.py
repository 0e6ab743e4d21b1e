"""``chain_hashes`` (the unrolled loop a register hashes its prompt with) against ``block_hash`` block by block: the
same bytes for every block size, prompt length, salt, extra key, parent hash and public prefix (the hashes are the
KV events' wire contract)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_server.core.block_hash import NONE_HASH, block_hash, block_header, chain_hashes, hash_many, salt_of


def chained_block_by_block(tokens: np.ndarray, block_size: int, salt: bytes, parent: bytes, extra: bytes,
                           num_public: int) -> list[bytes]:
    hashes = []
    for i, start in enumerate(range(0, tokens.size - block_size + 1, block_size)):
        parent = block_hash(parent, tokens[start : start + block_size], salt_of(i, num_public, salt), extra)
        hashes.append(parent)
    return hashes


@settings(max_examples=300, deadline=None)
@given(block_size=st.integers(1, 20), tokens=st.lists(st.integers(0, 2**32 - 1), max_size=90),
       salt=st.sampled_from([b"", b"t", "t\u00e9nant".encode()]), extra=st.sampled_from([b"", b"lora-x"]),
       parent=st.sampled_from([NONE_HASH, bytes(range(32))]), num_public=st.integers(0, 30), as_list=st.booleans())
def test_chain_hashes_equal_block_by_block(block_size: int, tokens: list[int], salt: bytes, extra: bytes,
                                           parent: bytes, num_public: int, as_list: bool) -> None:
    array = np.array(tokens, dtype=np.uint32)
    got = chain_hashes(tokens if as_list else array, block_size, salt, parent, extra, num_public)
    assert got == chained_block_by_block(array, block_size, salt, parent, extra, num_public)
    assert len(got) == len(tokens) // block_size


@settings(max_examples=100, deadline=None)
@given(blocks=st.lists(st.tuples(st.sampled_from([NONE_HASH, bytes(range(32))]), st.sampled_from([b"", b"t"]),
                                 st.sampled_from([b"", b"lora-x"]), st.lists(st.integers(0, 2**32 - 1), min_size=4,
                                                                             max_size=4)), max_size=20))
def test_hash_many_is_block_hash_of_each(blocks: list[tuple[bytes, bytes, bytes, list[int]]]) -> None:
    """The decode step's hashes, many chains' blocks at once, are each block's own ``block_hash``."""
    tokens = [np.array(t, dtype=np.uint32) for _, _, _, t in blocks]
    got = hash_many([p for p, _, _, _ in blocks], [block_header(s, e, 4) for _, s, e, _ in blocks],
                    [t.tobytes() for t in tokens])
    assert got == [block_hash(p, t, s, e) for (p, s, e, _), t in zip(blocks, tokens)]
