"""The batched block-copy kernel: every (src, dst) pair of a copy-on-write batch in ONE launch.

Grid: one thread block (CTA) per (copied block, chunk), flattened on x (or, with ``persistent``, as many CTAs as
are resident at once, each looping over items ``blockIdx.x, blockIdx.x + gridDim.x, ...``)::

    CTA id = copy * chunks_per_block + chunk
    block src ... | chunk 0 | chunk 1 | ... |      chunk = threads * unroll vectors
                   `- thread t moves vectors t, t + threads, ..., t + (unroll-1) * threads of its chunk

A thread issues all ``unroll`` loads before its first store, so ``unroll`` 16-byte loads per thread are in flight
(coalesced across the warp: lane i reads bytes 16i..16i+15 of each 512-byte warp span). Several CTAs per block
keep the grid large enough to fill all SMs even for a few large blocks, and short chunks finish together, so the
last wave is small. The vector is 16 bytes (``uint4``) when ``block_bytes % 16 == 0``; otherwise 8 or 4 bytes
(``block_bytes`` is always a multiple of 4: two (K, V) halves of 2- or 4-byte elements).

Pairs live in a device int32 buffer ``[c, 2]``; offsets are computed in 64 bits (pools beyond 4 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy

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

_VECTORS = {16: "uint4", 8: "uint2", 4: "unsigned int"}
_CACHE_HINTS = {  # plain loads/stores; evict-first streaming (data is touched once); read-only path
    "plain": ("(*(p))", "(*(p) = (v))"),
    "stream": ("__ldcs(p)", "__stcs((p), (v))"),
    "nc": ("__ldg(p)", "(*(p) = (v))"),
}


@dataclass(frozen=True)
class CopyConfig:
    """Launch shape: ``threads`` per CTA, ``unroll`` vectors per thread, cache hint of loads/stores, and whether
    the grid is one CTA per (copy, chunk) or persistent (as many CTAs as fit on the GPU at once, each looping)."""

    threads: int = 512
    unroll: int = 4
    cache: str = "plain"
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.threads not in (64, 128, 256, 512, 1024) or not 1 <= self.unroll <= 16:
            raise ValueError(f"bad CopyConfig {self}")
        if self.cache not in _CACHE_HINTS:
            raise ValueError(f"cache must be one of {sorted(_CACHE_HINTS)}, got {self.cache!r}")


# Measured on the H200 by scripts/gpu_device_check.py (docs/device.md): the nine variants tried all moved 84-93% of
# memcpy's bandwidth, their order changing between two runs (noise ~3%). This one is among the best in both runs and
# has the smallest chunk (16 KiB), so even a batch of one 64 KiB block spreads over 4 CTAs.
DEFAULT_CONFIG = CopyConfig(threads=256, unroll=4, cache="plain")


def vector_bytes(nbytes: int) -> int:
    """Widest vector (16, 8 or 4 bytes) that divides ``nbytes``."""
    for width in (16, 8, 4):
        if nbytes % width == 0:
            return width
    raise ValueError(f"{nbytes} bytes is not a multiple of 4")


def _resident_ctas(kernel: cupy.RawKernel, threads: int) -> int:
    """How many CTAs of ``kernel`` fit on the device at once (the grid of a persistent launch)."""
    from cupy_backends.cuda.api import driver

    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, threads, 0)
    return max(1, per_sm) * cupy.cuda.Device().attributes["MultiProcessorCount"]


class BlockCopier:
    """The copy kernel compiled for one ``block_bytes``; compiled and loaded in ``__init__`` (start-up), so a
    launch allocates nothing."""

    def __init__(self, block_bytes: int, config: CopyConfig = DEFAULT_CONFIG) -> None:
        self.block_bytes = int(block_bytes)
        self.config = config
        self.vec_bytes = vector_bytes(self.block_bytes)
        self.vecs_per_block = self.block_bytes // self.vec_bytes
        self.chunks_per_block = -(-self.vecs_per_block // (config.threads * config.unroll))
        load, store = _CACHE_HINTS[config.cache]
        source = _SOURCE.format(vec=_VECTORS[self.vec_bytes], load=load, store=store,
                                threads=config.threads, unroll=config.unroll)
        self._kernel = cupy.RawKernel(source, "kvpool_copy_blocks", options=("-std=c++17",))
        self._kernel.compile()
        self._resident_ctas = _resident_ctas(self._kernel, config.threads)

    def max_copies(self) -> int:
        return (2**31 - 1) // self.chunks_per_block

    def launch(self, base_ptr: int, pairs_ptr: int, num_copies: int, stream: cupy.cuda.Stream) -> None:
        """Enqueue the copy of ``num_copies`` pairs (device int32 [c, 2] at ``pairs_ptr``) on ``stream``."""
        if num_copies <= 0:
            return
        if num_copies > self.max_copies():
            raise ValueError(f"{num_copies} copies exceed one launch's grid ({self.max_copies()})")
        num_items = num_copies * self.chunks_per_block
        grid = (min(num_items, self._resident_ctas) if self.config.persistent else num_items,)
        args = (cupy.uint64(base_ptr), cupy.uint64(pairs_ptr), cupy.int64(self.block_bytes),
                cupy.int64(self.vecs_per_block), cupy.int32(self.chunks_per_block), cupy.int32(num_items))
        with stream:
            self._kernel(grid, (self.config.threads,), args)
