"""Scatter/gather between a caller's dense device arrays and the pool's slots: one CuPy RawKernel launch per call.

Every operation moves *rows*: one row is one token's K (or V) of one layer, ``row_bytes = H * D * itemsize``,
contiguous both in the pool and in the caller's array. A call moves ``n`` tokens x ``rows_per_token`` rows::

    whole tokens   data[n, L, 2, H, D]    rows_per_token = 2L   row r = (layer r // 2, K or V = r % 2)
    one layer      k[n, H, D], v[n, H, D] rows_per_token = 2    pool row 2 * layer + (0: K, 1: V)

    dense row r of token t:  base[r % 2] + t * token_stride[r % 2] + (r // 2) * 2 * row_bytes
    pool row (seg) of slot s: pool + (s // block_size) * block_stride + seg * seg_stride + (s % block_size) * row_bytes

``block_stride`` / ``seg_stride`` describe the layout (``KVLayout.strides``): block-major is ``(block_bytes,
segment_bytes)``, layer-major ``(segment_bytes, num_blocks * segment_bytes)``.
A thread moves ``UNROLL`` vectors of 16 bytes (8/4/2 when alignment forbids), issuing every load before its first
store; lanes of a warp touch consecutive vectors of a row (coalesced). Division by the row and token sizes is by
compile-time constants. A slot outside ``[0, num_slots)`` sets ``error[0] = 1``, which
``AttachedPool.check_slot_errors()`` reads: a write skips it (nothing is written outside the pool), a read writes
zeros in its rows of the caller's array (every row of the result is written: the caller may pass it uninitialised).
"""

from __future__ import annotations

from typing import Any

import cupy

_SOURCE = r"""
typedef {vec} vec_t;
typedef {slot_t} slot_t;
#define VPR {vpr}
#define RPT {rpt}
#define THREADS {threads}
#define UNROLL {unroll}
#define ROW_BYTES {row_bytes}LL

extern "C" __global__ void __launch_bounds__(THREADS)
kvpool_slot_rows(unsigned char* __restrict__ pool, unsigned char* __restrict__ dense_k,
                 unsigned char* __restrict__ dense_v, const long long stride_k, const long long stride_v,
                 const slot_t* __restrict__ slots, const long long num_tokens, const long long num_slots,
                 const long long block_size, const long long block_stride, const long long seg_stride,
                 const int first_seg, int* __restrict__ error, const int to_pool)
{{
    const long long total = num_tokens * (RPT * VPR);
    const long long first = (long long)blockIdx.x * (THREADS * UNROLL) + threadIdx.x;
    vec_t r[UNROLL];
    vec_t* dst[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {{
        const long long i = first + (long long)k * THREADS;
        dst[k] = nullptr;
        if (i >= total) continue;
        const long long token = i / (RPT * VPR);
        const int rem = (int)(i - token * (RPT * VPR));
        const int row = rem / VPR;
        const int v = rem - row * VPR;
        const long long slot = (long long)slots[token];
        vec_t* d = reinterpret_cast<vec_t*>((row & 1 ? dense_v + token * stride_v : dense_k + token * stride_k)
                                            + (row >> 1) * (2 * ROW_BYTES)) + v;
        if (slot < 0 || slot >= num_slots) {{
            if (rem == 0) atomicOr(error, 1);
            if (!to_pool) {{ r[k] = vec_t{{}}; dst[k] = d; }}  // a read: the caller's row zeroed
            continue;
        }}
        const long long block = slot / block_size;
        const long long offset = slot - block * block_size;
        vec_t* p = reinterpret_cast<vec_t*>(pool + block * block_stride + (first_seg + row) * seg_stride
                                            + offset * ROW_BYTES) + v;
        if (to_pool) {{ r[k] = *d; dst[k] = p; }} else {{ r[k] = *p; dst[k] = d; }}
    }}
#pragma unroll
    for (int k = 0; k < UNROLL; ++k)
        if (dst[k] != nullptr) *dst[k] = r[k];
}}
"""

_VECTORS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}
_SLOT_TYPES = {"int64": "long long", "int32": "int"}
THREADS = 128
_kernels: dict[tuple, cupy.RawKernel] = {}


def vector_bytes(*values: int) -> int:
    """The widest vector (16, 8, 4, 2 bytes) that divides every address, stride and row size given."""
    for width in (16, 8, 4, 2):
        if all(v % width == 0 for v in values):
            return width
    raise ValueError("rows must be 2-byte aligned")


def kernel(row_bytes: int, rows_per_token: int, vec: int, slot_dtype: str, unroll: int) -> cupy.RawKernel:
    """The kernel for one shape, compiled once per process (and cached by CuPy on disk)."""
    key = (row_bytes, rows_per_token, vec, slot_dtype, unroll, cupy.cuda.Device().id)
    k = _kernels.get(key)
    if k is None:
        source = _SOURCE.format(vec=_VECTORS[vec], slot_t=_SLOT_TYPES[slot_dtype], vpr=row_bytes // vec,
                                rpt=rows_per_token, threads=THREADS, unroll=unroll, row_bytes=row_bytes)
        k = cupy.RawKernel(source, "kvpool_slot_rows", options=("-std=c++17",))
        k.compile()
        _kernels[key] = k
    return k


_sm_count: dict[int, int] = {}


def launch(*, pool_ptr: int, dense_k: int, dense_v: int, stride_k: int, stride_v: int, slots_ptr: int,
           slot_dtype: str, num_tokens: int, rows_per_token: int, row_bytes: int, num_slots: int, block_size: int,
           block_stride: int, seg_stride: int, first_seg: int, error_ptr: int, to_pool: bool,
           stream: Any) -> None:
    """Enqueue one move on ``stream`` (a CuPy stream). Addresses are device pointers; strides in bytes."""
    if num_tokens <= 0:
        return
    vec = vector_bytes(row_bytes, dense_k, dense_v, stride_k, stride_v, pool_ptr, block_stride, seg_stride)
    vecs = num_tokens * rows_per_token * (row_bytes // vec)
    device = cupy.cuda.Device().id
    sms = _sm_count.get(device)
    if sms is None:
        sms = _sm_count[device] = cupy.cuda.Device().attributes["MultiProcessorCount"]
    unroll = 4 if vecs >= 8 * sms * THREADS * 4 else 1  # small moves: more CTAs, so every SM gets some
    k = kernel(row_bytes, rows_per_token, vec, slot_dtype, unroll)
    grid = (-(-vecs // (THREADS * unroll)),)
    args = (cupy.uint64(pool_ptr), cupy.uint64(dense_k), cupy.uint64(dense_v), cupy.int64(stride_k),
            cupy.int64(stride_v), cupy.uint64(slots_ptr), cupy.int64(num_tokens), cupy.int64(num_slots),
            cupy.int64(block_size), cupy.int64(block_stride), cupy.int64(seg_stride), cupy.int32(first_seg),
            cupy.uint64(error_ptr), cupy.int32(int(to_pool)))
    with stream:
        k(grid, (THREADS,), args)
