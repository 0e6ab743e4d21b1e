"""``chain_hashes`` (the unrolled loop a register hashes its prompt with) against ``block_hash`` block by block: the
same bytes for every block size, prompt length, salt, extra key, parent hash and public prefix (the hashes are the
KV events' wire contract)."""

from __future__ import annotations

import hashlib
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import block_hash as reference
from kvpool_server.core.block_hash import (NONE_HASH, block_hash, block_header, chain_hashes, hash_rows,
                                           salt_of)

try:
    from kvpool import _block_hash as native
except ImportError:
    native = None
needs_native = pytest.mark.skipif(native is None, reason="kvpool._block_hash is not built (no C compiler or OpenSSL "
                                                         "headers at install): the Python loops run")


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
def test_hash_rows_is_block_hash_of_each(blocks: list[tuple[bytes, bytes, bytes, list[int]]]) -> None:
    """The decode step's hashes, many chains' blocks at once (the rows of one array), are each block's own
    ``block_hash``."""
    tokens = [np.array(t, dtype=np.uint32) for _, _, _, t in blocks]
    rows = np.array([t for _, _, _, t in blocks], dtype=np.uint32).reshape(len(blocks), 4)
    assert hash_rows([p for p, _, _, _ in blocks], [block_header(s, e, 4) for _, s, e, _ in blocks], rows) == \
        [block_hash(p, t, s, e) for (p, s, e, _), t in zip(blocks, tokens)]



@needs_native
@settings(max_examples=300, deadline=None)
@given(block_bytes=st.integers(1, 80), data=st.binary(max_size=400), parent=st.binary(min_size=32, max_size=32),
       header_public=st.binary(max_size=20), header=st.binary(max_size=20), num_public=st.integers(0, 30),
       prefix=st.sampled_from([reference.DOMAIN, b""]))
def test_native_chain_is_the_python_loop(block_bytes: int, data: bytes, parent: bytes, header_public: bytes,
                                         header: bytes, num_public: int, prefix: bytes) -> None:
    """The C loop and the Python one hash the same bytes: one definition of the encoding (block_hash.py's)."""
    args = (prefix, parent, data, block_bytes, header_public, num_public, header)
    assert native.chain(*args) == reference.chain_loop(*args)


@needs_native
@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.binary(max_size=40), st.binary(max_size=20)), max_size=20),
       block_bytes=st.integers(-2, 24), extra_bytes=st.integers(-3, 3), as_array=st.booleans(),
       prefix=st.sampled_from([reference.DOMAIN, b""]), seed=st.integers(0, 2**32 - 1))
def test_native_many_flat_is_the_python_loop(pairs: list[tuple[bytes, bytes]], block_bytes: int, extra_bytes: int,
                                             as_array: bool, prefix: bytes, seed: int) -> None:
    """``many_flat`` (the decode step's blocks as one buffer): the same digests as the Python loop, each the sha256 of
    its prefix, parent, header and slice of the buffer -- and the same refusal (ValueError) for a buffer of the wrong length or blocks
    of no bytes."""
    parents, headers = [p for p, _ in pairs], [h for _, h in pairs]
    size = max(0, len(pairs) * block_bytes + extra_bytes)
    data: bytes | np.ndarray = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    if as_array:
        data = np.frombuffer(data, dtype=np.uint8).copy()
    args = (prefix, parents, headers, data, block_bytes)
    if block_bytes <= 0 or size != len(pairs) * block_bytes:
        for loop in (native.many_flat, reference.many_flat_loop):
            with pytest.raises(ValueError):
                loop(*args)
        return
    flat = bytes(data)
    expected = [hashlib.sha256(prefix + p + h + flat[at : at + block_bytes]).digest()
                for p, h, at in zip(parents, headers, range(0, size, block_bytes))]
    assert native.many_flat(*args) == reference.many_flat_loop(*args) == expected


@needs_native
@pytest.mark.parametrize("loop", ["native", "python"])
def test_bad_arguments_raise_the_same_errors(loop: str) -> None:
    """Both loops refuse what the other refuses, with the same exception type (the callers never pass it: the
    core hands them its own hashes and bytes)."""
    chain = native.chain if loop == "native" else reference.chain_loop
    with pytest.raises(ValueError):
        chain(b"", bytes(31), b"abcd", 4, b"", 0, b"")  # a parent of 31 bytes
    with pytest.raises(ValueError):
        chain(b"", bytes(32), b"abcd", 0, b"", 0, b"")  # blocks of 0 bytes
    many_flat = native.many_flat if loop == "native" else reference.many_flat_loop
    with pytest.raises(ValueError):
        many_flat(b"", [bytes(32)], [b"", b""], b"xxxx", 4)  # parents and headers of different lengths
    with pytest.raises(TypeError):
        many_flat(b"", ["not bytes"], [b""], b"xxxx", 4)
    with pytest.raises(TypeError):
        many_flat(b"", [bytes(32)], ["not bytes"], b"xxxx", 4)
    with pytest.raises(TypeError):
        many_flat(b"", [bytes(32)], [b""], "not a buffer", 4)
    with pytest.raises((BufferError, ValueError)):  # the buffer request's refusal, NumPy's or memoryview's
        many_flat(b"", [bytes(32)], [b""], memoryview(bytes(8))[::2], 4)


@needs_native
def test_chain_hashes_and_hash_rows_alike_on_either_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an install without the C module computes (block_hash's dispatch to the Python loops) is what one with
    it computes: a prompt of public, tenant and partial blocks; a decode step's blocks of several chains."""
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 2**32, 16 * 40 + 5, dtype=np.uint64).astype(np.uint32)
    parents = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(9)]
    headers = [block_header(b"t", b"lora", 16)] * 9
    blocks = [rng.integers(0, 2**32, 16, dtype=np.uint64).astype(np.uint32).tobytes() for _ in range(9)]
    rows = np.frombuffer(b"".join(blocks), dtype=np.uint32).reshape(9, 16)
    with_c = (chain_hashes(prompt, 16, b"t", NONE_HASH, b"lora", 3), hash_rows(parents, headers, rows))
    monkeypatch.setattr(reference, "_chain", reference.chain_loop)
    monkeypatch.setattr(reference, "_many_flat", reference.many_flat_loop)
    assert (chain_hashes(prompt, 16, b"t", NONE_HASH, b"lora", 3), hash_rows(parents, headers, rows)) == with_c
    assert with_c[1] == [reference.hash_encoded(p, h, b) for p, h, b in zip(parents, headers, blocks)]
    assert len(with_c[0]) == 40
