"""The batched block-copy kernel: every (src, dst) pair of a copy-on-write batch in ONE launch, in either layout.

A block is ``spans_per_block`` contiguous spans of ``span_bytes``: one span of ``block_bytes`` (block-major) or
``2L`` spans of ``segment_bytes``, one per (layer, K/V), ``seg_stride`` apart (layer-major; ``kvpool.layout``).
Span ``s`` of block ``b`` starts at ``b * block_stride + s * seg_stride``.

Grid: one thread block (CTA) per (copied block, span, chunk), flattened on x::

    CTA id = (copy * spans_per_block + span) * chunks_per_span + chunk
    span src ... | chunk 0 | chunk 1 | ... |      chunk = threads * unroll vectors
                  `- thread t moves vectors t, t + threads, ..., t + (unroll-1) * threads of its chunk

A thread issues all UNROLL loads before its first store, so UNROLL 16-byte loads per thread are in flight
(coalesced across the warp: lane i reads bytes 16i..16i+15 of each 512-byte warp span). Several CTAs per block
keep the grid large enough to fill all SMs even for a few large blocks, and short chunks finish together, so the
last wave is small. Spans shorter than a chunk get a smaller ``unroll`` (so threads are not left idle). The
vector is 16 bytes (``uint4``) when span and strides are multiples of 16; otherwise 8, 4 or 2 bytes.

Pairs live in a device int32 buffer ``[c, 2]``; offsets are computed in 64 bits (pools beyond 4 GiB).

Several pools of the same block shape on one device (the shards of a tensor-parallel group there) take the same
pairs in ONE launch: ``shard_bases`` is a device array of their base pointers and grid ``y`` picks the pool
(``gridDim.y`` = the number of pools); without it (null) the kernel copies in ``base0``, grid ``y`` = 1.

The launch shape is the one scripts/gpu_device_check.py chose on the H200 (docs/device.md): of the nine variants
it explores (threads, unroll, cache hints, persistent grids; scripts/copy_kernel_variants.py) all moved 84-93% of
memcpy's bandwidth, their order changing between runs (noise ~3%); 256 threads x 4 vectors is among the best in
every run and has the smallest chunk (16 KiB), so even a batch of one 64 KiB block spreads over 4 CTAs.
"""

from __future__ import annotations

import cupy

from kvpool.layout import KVLayout

THREADS = 256  # per CTA
UNROLL = 4  # vectors in flight per thread (fewer for spans shorter than a chunk)

_SOURCE = r"""
typedef {vec} vec_t;
#define LOAD(p) (*(p))
#define STORE(p, v) (*(p) = (v))

extern "C" __global__ void __launch_bounds__({threads})
kvpool_copy_blocks(unsigned char* base0, const unsigned long long* __restrict__ shard_bases,
                   const int* __restrict__ pairs, const long long block_stride, const long long seg_stride,
                   const long long vecs_per_span, const int chunks_per_span, const int spans_per_block,
                   const int num_items)
{{
    // the pool this CTA copies in: base0, or with shard_bases the base of shard blockIdx.y (one launch, k shards)
    unsigned char* const base = shard_bases ? reinterpret_cast<unsigned char*>(shard_bases[blockIdx.y]) : base0;
    const int items_per_copy = spans_per_block * chunks_per_span;
    for (long long item = blockIdx.x; item < num_items; item += gridDim.x) {{  // once: the grid covers every item
        const int copy = (int)(item / items_per_copy);
        const int rem = (int)(item - (long long)copy * items_per_copy);
        const int span = rem / chunks_per_span;
        const int chunk = rem - span * chunks_per_span;
        const long long span_off = (long long)span * seg_stride;
        const vec_t* __restrict__ src =
            reinterpret_cast<const vec_t*>(base + (long long)pairs[2 * copy] * block_stride + span_off);
        vec_t* __restrict__ dst =
            reinterpret_cast<vec_t*>(base + (long long)pairs[2 * copy + 1] * block_stride + span_off);
        const long long first = (long long)chunk * ({threads} * {unroll}) + threadIdx.x;
        vec_t r[{unroll}];
        if (first + ({unroll} - 1) * {threads} < vecs_per_span) {{
#pragma unroll
        for (int k = 0; k < {unroll}; ++k) r[k] = src[first + k * {threads}];
#pragma unroll
        for (int k = 0; k < {unroll}; ++k) dst[first + k * {threads}] = r[k];
    }} else {{
#pragma unroll
            for (int k = 0; k < {unroll}; ++k)
                if (first + k * {threads} < vecs_per_span) r[k] = LOAD(src + first + k * {threads});
#pragma unroll
            for (int k = 0; k < {unroll}; ++k)
                if (first + k * {threads} < vecs_per_span) STORE(dst + first + k * {threads}, r[k]);
        }}
    }}
}}
"""

VECTOR_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}


def vector_bytes(*nbytes: int) -> int:
    """Widest vector (16, 8, 4 or 2 bytes) that divides every one of ``nbytes`` (2: layer-major segments of odd
    rows of 2-byte elements)."""
    for width in (16, 8, 4, 2):
        if all(n % width == 0 for n in nbytes):
            return width
    raise ValueError(f"{nbytes} bytes are not multiples of 2")


class BlockCopier:
    """The copy kernel compiled for one block shape; compiled and loaded in ``__init__`` (start-up), so a launch
    allocates nothing.

    ``BlockCopier(block_bytes)`` copies whole contiguous blocks (block-major); ``BlockCopier.for_layout(layout,
    num_blocks)`` picks the spans of the layout's order."""

    def __init__(self, span_bytes: int, *, spans_per_block: int = 1, block_stride: int | None = None,
                 seg_stride: int = 0) -> None:
        self.span_bytes = int(span_bytes)
        self.spans_per_block = int(spans_per_block)
        self.block_stride = self.span_bytes if block_stride is None else int(block_stride)
        self.seg_stride = int(seg_stride)
        self.block_bytes = self.span_bytes * self.spans_per_block
        self.vec_bytes = vector_bytes(self.span_bytes, self.block_stride, self.seg_stride or self.span_bytes)
        self.vecs_per_span = self.span_bytes // self.vec_bytes
        # a span shorter than one chunk gets fewer vectors per thread rather than idle threads
        self.unroll = max(1, min(UNROLL, -(-self.vecs_per_span // THREADS)))
        self.chunks_per_span = -(-self.vecs_per_span // (THREADS * self.unroll))
        self.items_per_copy = self.spans_per_block * self.chunks_per_span
        source = _SOURCE.format(vec=VECTOR_TYPES[self.vec_bytes], threads=THREADS, unroll=self.unroll)
        self._kernel = cupy.RawKernel(source, "kvpool_copy_blocks", options=("-std=c++17",))
        self._kernel.compile()

    @classmethod
    def for_layout(cls, layout: KVLayout, num_blocks: int) -> BlockCopier:
        spans, span_bytes = layout.copy_spans(num_blocks)
        block_stride, seg_stride = layout.strides(num_blocks)
        return cls(span_bytes, spans_per_block=spans, block_stride=block_stride,
                   seg_stride=seg_stride if spans > 1 else 0)

    def max_copies(self) -> int:
        return (2**31 - 1) // self.items_per_copy

    def launch(self, base_ptr: int, pairs_ptr: int, num_copies: int, stream: cupy.cuda.Stream, *,
               shard_bases_ptr: int = 0, num_shards: int = 1) -> None:
        """Enqueue the copy of ``num_copies`` pairs (device int32 [c, 2] at ``pairs_ptr``) on ``stream``: in the
        pool at ``base_ptr``, or with ``shard_bases_ptr`` (device uint64 [num_shards], one pool base a shard, every
        pool of this block shape on the stream's device) in each of those pools, all in this one launch."""
        if num_copies <= 0:
            return
        if num_copies > self.max_copies():
            raise ValueError(f"{num_copies} copies exceed one launch's grid ({self.max_copies()})")
        num_items = num_copies * self.items_per_copy
        args = (cupy.uint64(base_ptr), cupy.uint64(shard_bases_ptr), cupy.uint64(pairs_ptr),
                cupy.int64(self.block_stride), cupy.int64(self.seg_stride), cupy.int64(self.vecs_per_span),
                cupy.int32(self.chunks_per_span), cupy.int32(self.spans_per_block), cupy.int32(num_items))
        with stream:
            self._kernel((num_items, num_shards if shard_bases_ptr else 1), (THREADS,), args)
