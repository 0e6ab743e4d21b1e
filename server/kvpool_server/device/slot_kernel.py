"""Token scatter/gather between a dense staging buffer and the pool's slots, in one launch per chunk of tokens.

It computes exactly what ``kvpool.layout.scatter_tokens`` / ``gather_tokens`` compute, without the index
arrays and temporaries that CuPy fancy indexing would allocate. One token's KV is ``2L`` rows of
``row_bytes = H * D * itemsize`` (row ``seg = 2 * layer + kv``); a row is contiguous in both places::

    staging (token-major):  token t, row seg  at  (t * 2L + seg) * row_bytes
    pool:                   slot s = block * block_size + offset,
                            row seg  at  block * block_stride + seg * seg_stride + offset * row_bytes
                            (block-major: block_bytes, segment_bytes; layer-major: segment_bytes,
                             num_blocks * segment_bytes -- ``KVLayout.strides``)

One thread moves one vector (16, 8 or 4 bytes, whichever divides ``row_bytes``; at least 2) of one row, with a
grid-stride loop. Slots are device int64.
"""

from __future__ import annotations

import cupy

from kvpool.layout import KVLayout

_SOURCE = r"""
typedef {vec} vec_t;

extern "C" __global__ void kvpool_slot_rows(unsigned char* __restrict__ pool, unsigned char* __restrict__ staging,
                                            const long long* __restrict__ slots, const long long num_tokens,
                                            const int rows_per_token, const int vecs_per_row,
                                            const long long row_bytes, const long long block_stride,
                                            const long long seg_stride, const long long block_size,
                                            const int to_pool)
{{
    const long long total = num_tokens * rows_per_token * vecs_per_row;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {{
        const long long row = i / vecs_per_row;
        const int v = (int)(i - row * vecs_per_row);
        const long long token = row / rows_per_token;
        const int seg = (int)(row - token * rows_per_token);
        const long long slot = slots[token];
        const long long block = slot / block_size;
        const long long offset = slot - block * block_size;
        vec_t* p = reinterpret_cast<vec_t*>(pool + block * block_stride + seg * seg_stride
                                                  + offset * row_bytes) + v;
        vec_t* s = reinterpret_cast<vec_t*>(staging + row * row_bytes) + v;
        if (to_pool) *p = *s; else *s = *p;
    }}
}}
"""

_VECTORS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}
_THREADS = 256


def _row_vector_bytes(row_bytes: int) -> int:
    for width in (16, 8, 4, 2):
        if row_bytes % width == 0:
            return width
    raise ValueError(f"row of {row_bytes} bytes is not a multiple of 2")


class SlotMover:
    """Scatter (staging -> slots) and gather (slots -> staging) kernel for one layout; compiled in ``__init__``."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.block_stride, self.seg_stride = layout.strides(num_blocks)
        self.row_bytes = layout.num_kv_heads * layout.head_dim * layout.itemsize
        self.vec_bytes = _row_vector_bytes(self.row_bytes)
        self.vecs_per_row = self.row_bytes // self.vec_bytes
        self.rows_per_token = 2 * layout.num_layers
        self._kernel = cupy.RawKernel(_SOURCE.format(vec=_VECTORS[self.vec_bytes]), "kvpool_slot_rows",
                                      options=("-std=c++17",))
        self._kernel.compile()
        self._max_ctas = 8 * cupy.cuda.Device().attributes["MultiProcessorCount"]

    def launch(self, pool_ptr: int, staging_ptr: int, slots_ptr: int, num_tokens: int, to_pool: bool,
               stream: cupy.cuda.Stream) -> None:
        """Move ``num_tokens`` tokens (slots: device int64 at ``slots_ptr``) between pool and staging on ``stream``."""
        total = num_tokens * self.rows_per_token * self.vecs_per_row
        if total <= 0:
            return
        grid = (min(-(-total // _THREADS), self._max_ctas),)
        args = (cupy.uint64(pool_ptr), cupy.uint64(staging_ptr), cupy.uint64(slots_ptr), cupy.int64(num_tokens),
                cupy.int32(self.rows_per_token), cupy.int32(self.vecs_per_row), cupy.int64(self.row_bytes),
                cupy.int64(self.block_stride), cupy.int64(self.seg_stride),
                cupy.int64(self.layout.block_size), cupy.int32(int(to_pool)))
        with stream:
            self._kernel(grid, (_THREADS,), args)
