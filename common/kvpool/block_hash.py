"""Content hashes of full blocks: chained, deterministic sha256 over a canonical byte encoding.

Every process, restart and router that encodes the same (parent hash, token ids, extra keys, salt) gets the same
32 bytes -- never Python's ``hash()``, which is salted per process. The encoding (docs/prefix-caching.md)::

    block_hash = sha256( b"kvpool.block.v1\\x00"
                         || parent_hash                       32 bytes; 32 zero bytes (NONE_HASH) for block 0
                         || u32le(len(salt))  || salt         the tenant's name, UTF-8 (empty without auth), or
                                                              PUBLIC_SALT for a block of a public prefix
                         || u32le(len(extra)) || extra        the sequence's cache_extra_key (LoRA, multimodal)
                         || u32le(n)          || n x u32le    the block's token ids, in order )

A public prefix (RegisterSequenceRequest.public_prefix_len) hashes its first full blocks with ``PUBLIC_SALT``, the
one byte 0xFF, which occurs in no UTF-8 string: no tenant's salt can equal it, not even tenant 0's empty one. The
blocks after it continue the same chain (parent = the last public hash) with the tenant's salt.

The loops of ``chain_hashes`` and ``hash_rows`` run in ``kvpool._block_hash`` (C over OpenSSL's
SHA-256, the GIL released while a long prompt hashes) where the install built it, and in Python otherwise, or when
``KVPOOL_NATIVE_HASH=0``; both hash the bytes this module assembles (the extension only concatenates the pieces it
is given), and tests/core/test_chain_hashes.py compares them. ``NATIVE`` says which runs.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Buffer

DOMAIN = b"kvpool.block.v1\x00"
NONE_HASH = bytes(32)  # the parent of a sequence's first block
PUBLIC_SALT = b"\xff"  # the salt of a public prefix's blocks: never valid UTF-8, so never a tenant's name
MAX_EXTRA_KEY_BYTES = 256  # the longest cache_extra_key (a LoRA adapter's name, a digest of multimodal inputs)
HEADER_CACHE_SIZE = 1024  # block_header's memo: headers kept (least recently used first out)
_U32 = struct.Struct("<I")


def _native_loops() -> ModuleType | None:
    """The C loops, unless not built (no C compiler or OpenSSL headers at install) or ``KVPOOL_NATIVE_HASH=0``."""
    if os.environ.get("KVPOOL_NATIVE_HASH", "1") == "0":
        return None
    try:
        from kvpool import _block_hash
    except ImportError:
        return None
    return _block_hash


_native = _native_loops()
NATIVE = _native is not None


def block_hash(parent_hash: bytes, token_ids: Sequence[int] | np.ndarray, salt: bytes = b"", extra: bytes = b"") -> bytes:
    """The 32-byte hash of one full block whose predecessor hashed to ``parent_hash`` (NONE_HASH for the first)."""
    tokens = np.asarray(token_ids, dtype="<u4")
    return hash_encoded(parent_hash, block_header(salt, extra, tokens.size), tokens.tobytes())


@functools.lru_cache(maxsize=HEADER_CACHE_SIZE)
def block_header(salt: bytes, extra: bytes, num_tokens: int) -> bytes:
    """The encoding's bytes between the parent hash and the token ids: salt, extra key, token count (the same for
    every block of a sequence but its public ones: a hot loop computes them once). Memoized (a register needs one or
    two; a few tenants and extra keys make most of them): at most HEADER_CACHE_SIZE headers, each kept with its
    arguments (a tenant's name, an extra key of at most MAX_EXTRA_KEY_BYTES), least recently used out first."""
    return _U32.pack(len(salt)) + salt + _U32.pack(len(extra)) + extra + _U32.pack(num_tokens)


def hash_encoded(parent_hash: bytes, header: bytes, token_bytes: bytes) -> bytes:
    """``block_hash`` given the block's ``block_header`` and its token ids as u32le bytes."""
    return hashlib.sha256(DOMAIN + parent_hash + header + token_bytes).digest()


def hash_rows(parents: Sequence[bytes], headers: Sequence[bytes], tokens: np.ndarray) -> list[bytes]:
    """``hash_encoded`` of each (parent hash, header, block): many blocks of different chains at once, in one call,
    the blocks given as the rows of one array (``tokens``: [len(parents), block_size] token ids, a
    decode step's filled blocks): their u32le bytes one buffer, no bytes object a block."""
    data = np.ascontiguousarray(tokens, dtype="<u4")
    return _many_flat(DOMAIN, parents, headers, data.data, data.shape[1] * 4 if data.ndim == 2 else 0)


def chain_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, salt: bytes = b"",
                 parent_hash: bytes = NONE_HASH, extra: bytes = b"", num_public: int = 0) -> list[bytes]:
    """The hashes of every full block of ``token_ids`` (a partial tail is not hashed), chained from ``parent_hash``:
    the first ``num_public`` with ``PUBLIC_SALT``, the others with ``salt``; every one with ``extra``.

    ``block_hash`` per block, unrolled (a register hashes its whole prompt): the token ids made bytes once, each
    block a slice of them, each of the (at most two) headers encoded once."""
    return chain_encoded(np.asarray(token_ids, dtype="<u4").tobytes(), block_size, salt, parent_hash, extra,
                         num_public)


def chain_encoded(data: bytes, block_size: int, salt: bytes = b"", parent_hash: bytes = NONE_HASH, extra: bytes = b"",
                  num_public: int = 0) -> list[bytes]:
    """``chain_hashes`` given the token ids as u32le bytes (``data``; a partial tail is not hashed)."""
    return _chain(DOMAIN, parent_hash, data, block_size * 4, block_header(PUBLIC_SALT, extra, block_size),
                  num_public, block_header(salt, extra, block_size))


def chain_loop(prefix: bytes, parent: bytes, data: bytes, block_bytes: int, header_public: bytes, num_public: int,
               header: bytes) -> list[bytes]:
    """``kvpool._block_hash.chain`` in Python: sha256(prefix || parent || header || block) for each whole block
    of ``data``, chained (each block's parent the digest before); the first ``num_public`` with
    ``header_public``."""
    if len(parent) != 32 or block_bytes <= 0 or num_public < 0:
        raise ValueError("chain: parent must be 32 bytes, block_bytes > 0, num_public >= 0")
    end = len(data) - len(data) % block_bytes
    split = min(num_public * block_bytes, end)  # the public blocks' bytes end here
    hashes: list[bytes] = []
    sha256 = hashlib.sha256
    for start, stop, head in ((0, split, header_public), (split, end, header)):
        for at in range(start, stop, block_bytes):
            parent = sha256(prefix + parent + head + data[at : at + block_bytes]).digest()
            hashes.append(parent)
    return hashes


def many_flat_loop(prefix: bytes, parents: Sequence[bytes], headers: Sequence[bytes], data: Buffer,
                   block_bytes: int) -> list[bytes]:
    """``kvpool._block_hash.many_flat`` in Python: sha256(prefix || parent || header || block) of each, block i
    bytes [i * block_bytes, (i + 1) * block_bytes) of ``data`` (exactly len(parents) blocks)."""
    view = memoryview(data)
    if not view.c_contiguous:  # as the C side's buffer request refuses it
        raise BufferError("many_flat: data must be one contiguous buffer")
    flat = view.tobytes()
    if len(parents) != len(headers) or block_bytes <= 0 or len(flat) != len(parents) * block_bytes:
        raise ValueError("many_flat: parents and headers equally long, block_bytes > 0, data len(parents) blocks")
    if not all(isinstance(p, bytes) and isinstance(h, bytes) for p, h in zip(parents, headers)):
        raise TypeError("many_flat: every parent and header must be bytes")
    sha256 = hashlib.sha256
    return [sha256(prefix + p + h + flat[at : at + block_bytes]).digest()
            for p, h, at in zip(parents, headers, range(0, len(flat), block_bytes))]


_chain, _many_flat = (chain_loop, many_flat_loop) if _native is None else (_native.chain, _native.many_flat)


def salt_of(block_index: int, num_public: int, salt: bytes) -> bytes:
    """The salt of logical block ``block_index`` of a sequence whose first ``num_public`` blocks are public."""
    return PUBLIC_SALT if block_index < num_public else salt
