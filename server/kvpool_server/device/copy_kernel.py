"""The batched block-copy kernel: every (src, dst) pair of a copy-on-write batch in ONE launch.

Grid: one thread block (CTA) per (copied block, chunk), flattened on x::

    CTA id = copy * chunks_per_block + chunk
    block src ... | chunk 0 | chunk 1 | ... |      chunk = THREADS * UNROLL vectors
                   `- thread t moves vectors t, t + THREADS, ..., t + (UNROLL-1) * THREADS of its chunk

A thread issues all UNROLL loads before its first store, so UNROLL 16-byte loads per thread are in flight
(coalesced across the warp: lane i reads bytes 16i..16i+15 of each 512-byte warp span). Several CTAs per block
keep the grid large enough to fill all SMs even for a few large blocks, and short chunks finish together, so the
last wave is small. The vector is 16 bytes (``uint4``) when ``block_bytes % 16 == 0``; otherwise 8 or 4 bytes
(``block_bytes`` is always a multiple of 4: two (K, V) halves of 2- or 4-byte elements).

Pairs live in a device int32 buffer ``[c, 2]``; offsets are computed in 64 bits (pools beyond 4 GiB).

The launch shape is the one scripts/gpu_device_check.py chose on the H200 (docs/device.md): of the nine variants
it explores (threads, unroll, cache hints, persistent grids; scripts/copy_kernel_variants.py) all moved 84-93% of
memcpy's bandwidth, their order changing between runs (noise ~3%); 256 threads x 4 vectors is among the best in
every run and has the smallest chunk (16 KiB), so even a batch of one 64 KiB block spreads over 4 CTAs.
"""

from __future__ import annotations

import cupy

THREADS = 256  # per CTA
UNROLL = 4  # vectors in flight per thread

_SOURCE = r"""
typedef {vec} vec_t;

extern "C" __global__ void __launch_bounds__({threads})
kvpool_copy_blocks(unsigned char* __restrict__ base, const int* __restrict__ pairs, const long long block_bytes,
                   const long long vecs_per_block, const int chunks_per_block)
{{
    const long long item = blockIdx.x;
    const int copy = (int)(item / chunks_per_block);
    const int chunk = (int)(item - (long long)copy * chunks_per_block);
    const vec_t* __restrict__ src = reinterpret_cast<const vec_t*>(base + (long long)pairs[2 * copy] * block_bytes);
    vec_t* __restrict__ dst = reinterpret_cast<vec_t*>(base + (long long)pairs[2 * copy + 1] * block_bytes);
    const long long first = (long long)chunk * ({threads} * {unroll}) + threadIdx.x;
    vec_t r[{unroll}];
    if (first + ({unroll} - 1) * {threads} < vecs_per_block) {{
#pragma unroll
        for (int k = 0; k < {unroll}; ++k) r[k] = src[first + k * {threads}];
#pragma unroll
        for (int k = 0; k < {unroll}; ++k) dst[first + k * {threads}] = r[k];
    }} else {{
#pragma unroll
        for (int k = 0; k < {unroll}; ++k)
            if (first + k * {threads} < vecs_per_block) r[k] = src[first + k * {threads}];
#pragma unroll
        for (int k = 0; k < {unroll}; ++k)
            if (first + k * {threads} < vecs_per_block) dst[first + k * {threads}] = r[k];
    }}
}}
"""

VECTOR_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int"}


def vector_bytes(nbytes: int) -> int:
    """Widest vector (16, 8 or 4 bytes) that divides ``nbytes``."""
    for width in (16, 8, 4):
        if nbytes % width == 0:
            return width
    raise ValueError(f"{nbytes} bytes is not a multiple of 4")


class BlockCopier:
    """The copy kernel compiled for one ``block_bytes``; compiled and loaded in ``__init__`` (start-up), so a
    launch allocates nothing."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = int(block_bytes)
        self.vec_bytes = vector_bytes(self.block_bytes)
        self.vecs_per_block = self.block_bytes // self.vec_bytes
        self.chunks_per_block = -(-self.vecs_per_block // (THREADS * UNROLL))
        source = _SOURCE.format(vec=VECTOR_TYPES[self.vec_bytes], threads=THREADS, unroll=UNROLL)
        self._kernel = cupy.RawKernel(source, "kvpool_copy_blocks", options=("-std=c++17",))
        self._kernel.compile()

    def max_copies(self) -> int:
        return (2**31 - 1) // self.chunks_per_block

    def launch(self, base_ptr: int, pairs_ptr: int, num_copies: int, stream: cupy.cuda.Stream) -> None:
        """Enqueue the copy of ``num_copies`` pairs (device int32 [c, 2] at ``pairs_ptr``) on ``stream``."""
        if num_copies <= 0:
            return
        if num_copies > self.max_copies():
            raise ValueError(f"{num_copies} copies exceed one launch's grid ({self.max_copies()})")
        args = (cupy.uint64(base_ptr), cupy.uint64(pairs_ptr), cupy.int64(self.block_bytes),
                cupy.int64(self.vecs_per_block), cupy.int32(self.chunks_per_block))
        with stream:
            self._kernel((num_copies * self.chunks_per_block,), (THREADS,), args)
