"""NumPy references of every data-path operation: the host backend's implementation and the tests' oracle.

Slots address tokens (``slot = block_id * block_size + offset``); a blocks view is the pool's
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (``kvpool.layout``)::

    write_tokens:  data[n, L, 2, H, D]  ->  blocks[slot // bs, :, :, slot % bs]
    write_layer:   k[n, H, D], v[n, H, D]  ->  blocks[slot // bs, layer, 0 | 1, slot % bs]

Paged decode attention: one query token per sequence, its context read through a block table::

    block_tables[b] = [7, 2, 9]   seq_lens[b] = 40   block_size = 16
    token t of sequence b lives at k_cache[block_tables[b, t // 16], t % 16]     (t < 40)
    out[b, h] = softmax(scale * q[b, h] . K[b, :, h // group]) @ V[b, :, h // group],  group = Hq // Hkv
"""

from __future__ import annotations

from typing import Any

import numpy as np


def split_slots(slots: Any, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    return slots // block_size, slots % block_size


def write_tokens(blocks: np.ndarray, slots: Any, data: np.ndarray) -> None:
    """``data`` [n, L, 2, H, D] into ``slots`` of ``blocks``."""
    block_ids, offsets = split_slots(slots, blocks.shape[3])
    blocks[block_ids, :, :, offsets] = data


def read_tokens(blocks: np.ndarray, slots: Any) -> np.ndarray:
    """A copy of the KV at ``slots`` as [n, L, 2, H, D]."""
    block_ids, offsets = split_slots(slots, blocks.shape[3])
    return blocks[block_ids, :, :, offsets]


def write_layer(blocks: np.ndarray, layer: int, slots: Any, k: np.ndarray, v: np.ndarray) -> None:
    """One layer's K and V [n, H, D] into ``slots`` (what vLLM's ``reshape_and_cache`` does)."""
    block_ids, offsets = split_slots(slots, blocks.shape[3])
    blocks[block_ids, layer, 0, offsets] = k
    blocks[block_ids, layer, 1, offsets] = v


def read_layer(blocks: np.ndarray, layer: int, slots: Any) -> tuple[np.ndarray, np.ndarray]:
    """Copies of one layer's K and V at ``slots``, each [n, H, D]."""
    block_ids, offsets = split_slots(slots, blocks.shape[3])
    return blocks[block_ids, layer, 0, offsets], blocks[block_ids, layer, 1, offsets]


def as_float(x: np.ndarray, dtype: str) -> np.ndarray:
    """Storage values as float64; ``bfloat16`` is stored as uint16 bit patterns (the top half of a float32)."""
    if dtype == "bfloat16":
        return (np.asarray(x, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def gather_context(k_cache: np.ndarray, block_table: Any, seq_len: int) -> np.ndarray:
    """Tokens [0, seq_len) of one sequence from a paged cache [num_blocks, block_size, H, D], as [seq_len, H, D]."""
    block_size = k_cache.shape[1]
    positions = np.arange(seq_len)
    table = np.asarray(block_table, dtype=np.int64)
    return k_cache[table[positions // block_size], positions % block_size]


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool = False) -> np.ndarray:
    """Plain attention in float64. q [Sq, Hq, D], k and v [Sk, Hkv, D] (GQA: Hq a multiple of Hkv) -> [Sq, Hq, D].

    ``causal``: query i (the last Sq of Sk positions) sees keys up to position Sk - Sq + i."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    group = hq // hkv
    k = np.repeat(k, group, axis=1)  # [Sk, Hq, D]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        allowed = np.arange(sk)[None, :] <= (sk - sq + np.arange(sq))[:, None]
        scores = np.where(allowed[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, v)


def paged_decode_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: Any,
                           seq_lens: Any, scale: float | None = None, dtype: str = "float32") -> np.ndarray:
    """q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (storage dtype ``dtype``);
    block_tables int [B, max_blocks]; seq_lens int [B] -> float64 [B, Hq, D]."""
    q = as_float(q, dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = np.empty(q.shape, dtype=np.float64)
    for b, seq_len in enumerate(np.asarray(seq_lens, dtype=np.int64)):
        k = as_float(gather_context(k_cache, block_tables[b], int(seq_len)), dtype)
        v = as_float(gather_context(v_cache, block_tables[b], int(seq_len)), dtype)
        out[b] = dense_attention(q[b][None], k, v, scale)[0]
    return out
