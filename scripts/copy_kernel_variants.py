"""The copy-kernel variants scripts/gpu_device_check.py explores; the server keeps only the one it chose
(server/kvpool_server/device/copy_kernel.py, 256 threads x 4 vectors, plain loads, one CTA per item).

The same kernel as the server's, with more knobs: ``threads`` per CTA, ``unroll`` vectors per thread, the cache
hint of loads/stores (``plain``; ``stream``: evict-first ``__ldcs/__stcs``, the data is touched once; ``nc``: the
read-only path ``__ldg``), and a persistent grid (as many CTAs as are resident at once, from the occupancy API,
each looping over items ``blockIdx.x, blockIdx.x + gridDim.x, ...``) instead of one CTA per (copy, chunk).
``VariantCopier`` launches like the server's ``BlockCopier``: ``launch(base_ptr, pairs_ptr, num_copies, stream)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy

from kvpool_server.device.copy_kernel import VECTOR_TYPES, vector_bytes

_SOURCE = r"""
typedef {vec} vec_t;
#define LOAD(p) {load}
#define STORE(p, v) {store}

extern "C" __global__ void __launch_bounds__({threads})
kvpool_copy_blocks(unsigned char* __restrict__ base, const int* __restrict__ pairs, const long long block_bytes,
                   const long long vecs_per_block, const int chunks_per_block, const int num_items)
{{
    for (long long item = blockIdx.x; item < num_items; item += gridDim.x) {{  // once, unless persistent
        const int copy = (int)(item / chunks_per_block);
        const int chunk = (int)(item - (long long)copy * chunks_per_block);
        const vec_t* __restrict__ src =
            reinterpret_cast<const vec_t*>(base + (long long)pairs[2 * copy] * block_bytes);
        vec_t* __restrict__ dst = reinterpret_cast<vec_t*>(base + (long long)pairs[2 * copy + 1] * block_bytes);
        const long long first = (long long)chunk * ({threads} * {unroll}) + threadIdx.x;
        vec_t r[{unroll}];
        if (first + ({unroll} - 1) * {threads} < vecs_per_block) {{
#pragma unroll
            for (int k = 0; k < {unroll}; ++k) r[k] = LOAD(src + first + k * {threads});
#pragma unroll
            for (int k = 0; k < {unroll}; ++k) STORE(dst + first + k * {threads}, r[k]);
        }} else {{
#pragma unroll
            for (int k = 0; k < {unroll}; ++k)
                if (first + k * {threads} < vecs_per_block) r[k] = LOAD(src + first + k * {threads});
#pragma unroll
            for (int k = 0; k < {unroll}; ++k)
                if (first + k * {threads} < vecs_per_block) STORE(dst + first + k * {threads}, r[k]);
        }}
    }}
}}
"""

CACHE_HINTS = {
    "plain": ("(*(p))", "(*(p) = (v))"),
    "stream": ("__ldcs(p)", "__stcs((p), (v))"),
    "nc": ("__ldg(p)", "(*(p) = (v))"),
}


@dataclass(frozen=True)
class CopyConfig:
    """Launch shape: ``threads`` per CTA, ``unroll`` vectors per thread, cache hint of loads/stores, and whether
    the grid is one CTA per (copy, chunk) or persistent."""

    threads: int = 256
    unroll: int = 4
    cache: str = "plain"
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.threads not in (64, 128, 256, 512, 1024) or not 1 <= self.unroll <= 16:
            raise ValueError(f"bad CopyConfig {self}")
        if self.cache not in CACHE_HINTS:
            raise ValueError(f"cache must be one of {sorted(CACHE_HINTS)}, got {self.cache!r}")


VARIANTS = {  # t<threads per CTA>u<16-byte vectors per thread>; cs: streaming cache hints; nc: __ldg; p: persistent
    "t512u4": CopyConfig(512, 4, "plain"),
    "t256u8": CopyConfig(256, 8, "plain"),
    "t256u4": CopyConfig(256, 4, "plain"),  # the server's kernel
    "t1024u4": CopyConfig(1024, 4, "plain"),
    "t512u4cs": CopyConfig(512, 4, "stream"),
    "t128u8nc": CopyConfig(128, 8, "nc"),
    "t256u16": CopyConfig(256, 16, "plain"),
    "t512u4p": CopyConfig(512, 4, "plain", persistent=True),
    "t256u8p": CopyConfig(256, 8, "plain", persistent=True),
}


def _resident_ctas(kernel: cupy.RawKernel, threads: int) -> int:
    """How many CTAs of ``kernel`` fit on the device at once (the grid of a persistent launch)."""
    from cupy_backends.cuda.api import driver

    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, threads, 0)
    return max(1, per_sm) * cupy.cuda.Device().attributes["MultiProcessorCount"]


class VariantCopier:
    """One variant compiled for one ``block_bytes``."""

    def __init__(self, block_bytes: int, config: CopyConfig) -> None:
        self.block_bytes = int(block_bytes)
        self.config = config
        self.vec_bytes = vector_bytes(self.block_bytes)
        self.vecs_per_block = self.block_bytes // self.vec_bytes
        self.chunks_per_block = -(-self.vecs_per_block // (config.threads * config.unroll))
        load, store = CACHE_HINTS[config.cache]
        source = _SOURCE.format(vec=VECTOR_TYPES[self.vec_bytes], load=load, store=store,
                                threads=config.threads, unroll=config.unroll)
        self._kernel = cupy.RawKernel(source, "kvpool_copy_blocks", options=("-std=c++17",))
        self._kernel.compile()
        self.resident_ctas = _resident_ctas(self._kernel, config.threads)

    def launch(self, base_ptr: int, pairs_ptr: int, num_copies: int, stream: cupy.cuda.Stream) -> None:
        """Enqueue the copy of ``num_copies`` pairs (device int32 [c, 2] at ``pairs_ptr``) on ``stream``."""
        if num_copies <= 0:
            return
        num_items = num_copies * self.chunks_per_block
        grid = (min(num_items, self.resident_ctas) if self.config.persistent else num_items,)
        args = (cupy.uint64(base_ptr), cupy.uint64(pairs_ptr), cupy.int64(self.block_bytes),
                cupy.int64(self.vecs_per_block), cupy.int32(self.chunks_per_block), cupy.int32(num_items))
        with stream:
            self._kernel(grid, (self.config.threads,), args)
