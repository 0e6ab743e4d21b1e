"""The batched block-zero kernel: every block of a ``zero_blocks`` batch cleared in ONE launch, in either layout.

A block is the same spans as for the copy kernel (``copy_kernel.py``): one span of ``block_bytes`` (block-major)
or ``2L`` spans of ``segment_bytes``, ``seg_stride`` apart (layer-major). Span ``s`` of block ``b`` starts at
``b * block_stride + s * seg_stride``.

Grid: one CTA per (zeroed block, span, chunk), flattened on x -- the copy kernel's shape, with stores only::

    CTA id = (block * spans_per_block + span) * chunks_per_span + chunk
    thread t stores zero vectors t, t + threads, ..., t + (unroll-1) * threads of its chunk

Vectors of 16 bytes (``uint4``) when span and strides are multiples of 16, else 8, 4 or 2. Block ids live in a
device int32 buffer ``[n]``; offsets are 64-bit. Duplicated ids are harmless (a block is zeroed twice). Several
pools of one block shape on one device are cleared in ONE launch the copy kernel's way (``shard_bases``, grid
``y`` picks the pool).
"""

from __future__ import annotations

import cupy

from kvpool.layout import KVLayout
from kvpool_server.device.copy_kernel import THREADS, UNROLL, VECTOR_TYPES, vector_bytes

_SOURCE = r"""
typedef {vec} vec_t;

extern "C" __global__ void __launch_bounds__({threads})
kvpool_zero_blocks(unsigned char* base0, const unsigned long long* __restrict__ shard_bases,
                   const int* __restrict__ ids, const long long block_stride, const long long seg_stride,
                   const long long vecs_per_span, const int chunks_per_span, const int spans_per_block,
                   const int num_items)
{{
    // the pool this CTA clears in: base0, or with shard_bases the base of shard blockIdx.y (one launch, k shards)
    unsigned char* const base = shard_bases ? reinterpret_cast<unsigned char*>(shard_bases[blockIdx.y]) : base0;
    const int items_per_block = spans_per_block * chunks_per_span;
    for (long long item = blockIdx.x; item < num_items; item += gridDim.x) {{  // once: the grid covers every item
        const int k = (int)(item / items_per_block);
        const int rem = (int)(item - (long long)k * items_per_block);
        const int span = rem / chunks_per_span;
        const int chunk = rem - span * chunks_per_span;
        vec_t* __restrict__ dst = reinterpret_cast<vec_t*>(base + (long long)ids[k] * block_stride
                                                           + (long long)span * seg_stride);
        const long long first = (long long)chunk * ({threads} * {unroll}) + threadIdx.x;
        const vec_t zero{{}};  // value-initialised: every lane 0
#pragma unroll
        for (int u = 0; u < {unroll}; ++u)
            if (first + u * {threads} < vecs_per_span) dst[first + u * {threads}] = zero;
    }}
}}
"""


class BlockZeroer:
    """The zero kernel compiled for one layout's block shape; compiled and loaded in ``__init__`` (start-up), so a
    launch allocates nothing."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        spans, span_bytes = layout.copy_spans(num_blocks)
        block_stride, seg_stride = layout.strides(num_blocks)
        self.span_bytes = int(span_bytes)
        self.spans_per_block = int(spans)
        self.block_stride = int(block_stride)
        self.seg_stride = int(seg_stride) if spans > 1 else 0
        self.vec_bytes = vector_bytes(self.span_bytes, self.block_stride, self.seg_stride or self.span_bytes)
        self.vecs_per_span = self.span_bytes // self.vec_bytes
        self.unroll = max(1, min(UNROLL, -(-self.vecs_per_span // THREADS)))
        self.chunks_per_span = -(-self.vecs_per_span // (THREADS * self.unroll))
        self.items_per_block = self.spans_per_block * self.chunks_per_span
        source = _SOURCE.format(vec=VECTOR_TYPES[self.vec_bytes], threads=THREADS, unroll=self.unroll)
        self._kernel = cupy.RawKernel(source, "kvpool_zero_blocks", options=("-std=c++17",))
        self._kernel.compile()

    def max_blocks(self) -> int:
        return (2**31 - 1) // self.items_per_block

    def launch(self, base_ptr: int, ids_ptr: int, num_ids: int, stream: cupy.cuda.Stream, *,
               shard_bases_ptr: int = 0, num_shards: int = 1) -> None:
        """Enqueue the zeroing of ``num_ids`` blocks (device int32 [n] at ``ids_ptr``) on ``stream``: in the pool at
        ``base_ptr``, or with ``shard_bases_ptr`` (device uint64 [num_shards]) in each of those pools, in this one
        launch (``BlockCopier.launch``'s rule)."""
        if num_ids <= 0:
            return
        if num_ids > self.max_blocks():
            raise ValueError(f"{num_ids} blocks exceed one launch's grid ({self.max_blocks()})")
        num_items = num_ids * self.items_per_block
        args = (cupy.uint64(base_ptr), cupy.uint64(shard_bases_ptr), cupy.uint64(ids_ptr),
                cupy.int64(self.block_stride), cupy.int64(self.seg_stride), cupy.int64(self.vecs_per_span),
                cupy.int32(self.chunks_per_span), cupy.int32(self.spans_per_block), cupy.int32(num_items))
        with stream:
            self._kernel((num_items, num_shards if shard_bases_ptr else 1), (THREADS,), args)
