"""Whole-block copies between vLLM's per-layer KV cache views and kvpool's pool tensor, in one kernel launch.

The two sides (``BlockCopier``)::

    vLLM:  layer l's K and V, each a view [num_blocks, block_size, heads, head] (``worker.kv_views``), the
           2 x layers views separate allocations (one per layer) that share one set of strides
    pool:  one tensor, logical [num_blocks, layers, 2, block_size, heads, head] (any strides; head's is 1)

    a copy: block pairs (pool id, vLLM id); every layer's K and V of each pair, into vLLM (a load) or out of it
            (a store)

On CUDA the copy is one Triton launch: a program per (``blocks_per_program`` consecutive pairs, layer) moves that
layer's K and V of each of its blocks (two regions of ``block_size x heads`` rows of ``head`` contiguous elements) a
tile of ``tile_bytes`` at a time, the layout's permutation done by the strides (vLLM's NHD ``[blocks, block_size,
heads, 2 x head]`` and HND ``[blocks, heads, block_size, 2 x head]`` memory orders, the CPU backend's split alike).
The layers are reached from one base pointer (layer 0's K) through a table of offsets ``[layers, 2]`` (each view's
address minus the base's), made once per ``BlockCopier`` and word size -- offsets rather than pointers: plain
pointer arithmetic, which Triton's interpreter also runs on CPU tensors (the tests), and values whose alignment the
compiler can be told: their common power-of-two factor (at most 16 bytes), with which it proves every row 16-byte
aligned and loads and stores 16 bytes a thread. The bytes are copied as integers of ``word_bytes`` (at most; the
widest that the head's bytes, every stride and offset divide, never narrower than an element), so any dtype is
copied exactly. The copy's ids reach the device as one vector [pool ids, vLLM ids] through two reused pinned
stages (``IdStages``: one upload queued on the stream, no allocation). The variant (``copy_config.CopyConfig``, ``DEFAULT``) is chosen
by ``benchmarks/sweep_vllm_copy.py``; every one is one kernel definition, its constexpr parameters.
The first copy of a process compiles the kernel (about a second; Triton caches it on disk).

The PyTorch path (per layer advanced indexing, ``_torch_copy``) runs instead where the kernel does not: tensors
on the CPU (vLLM's CPU backend), Triton not installed, the pool and vLLM on different devices, a pool dtype that
is not vLLM's, a pool whose shape is not ``[blocks, layers, 2, <vLLM's block>]``, per-layer views of different
shapes, strides or dtypes, or a head dimension that is not contiguous on either side -- ``kernel_refusal`` says
which. Block ids outside either side's range raise ``ValueError`` before either path runs (the kernel does not
check them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvpool_client.integrations.vllm.block_pairs import check_pairs, pair_ids
from kvpool_client.integrations.vllm.copy_config import CopyConfig, IdStages, KernelLaunch, RawLaunch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path below still works
    triton = None

DEFAULT = CopyConfig(tile_bytes=32768)  # the sweep's best on the H200 (Llama-3-8B, NHD): 0.91x store, 0.92x load of copy_
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


if triton is not None:

    # The ids and their count are not specialised on (alignment, divisibility): one compiled kernel serves every copy
    # of a pool layout and direction, so a copy after the first can launch it directly (``KernelLaunch.compiled``).
    @triton.jit(do_not_specialize=["IDS", "n_pairs"])
    def _block_copy_kernel(VLLM, POOL, LAYER_OFFS, IDS, n_pairs,
                           v_sb, v_st, v_sh, p_sb, p_sl, p_skv, p_st, p_sh,
                           TOKENS: tl.constexpr, HEADS: tl.constexpr, HEAD: tl.constexpr, HEAD_P: tl.constexpr,
                           ROWS: tl.constexpr, ALIGN: tl.constexpr, INTO_VLLM: tl.constexpr,
                           BLOCKS_PER_PROGRAM: tl.constexpr, EVICT: tl.constexpr):
        layer = tl.program_id(1)
        k_off = tl.multiple_of(tl.load(LAYER_OFFS + layer * 2), ALIGN)
        v_off = tl.multiple_of(tl.load(LAYER_OFFS + layer * 2 + 1), ALIGN)
        offs_r = tl.arange(0, ROWS)
        offs_d = tl.arange(0, HEAD_P)
        for i in range(BLOCKS_PER_PROGRAM):  # this program's pairs: consecutive in the ids, one layer
            pair = tl.program_id(0) * BLOCKS_PER_PROGRAM + i
            if pair < n_pairs:
                pid = tl.load(IDS + pair).to(tl.int64)  # IDS: [pool ids, vLLM ids] (IdStages)
                vid = tl.load(IDS + n_pairs + pair).to(tl.int64)
                v_block = vid * v_sb
                p_block = pid * p_sb + layer.to(tl.int64) * p_sl
                for r0 in range(0, TOKENS * HEADS, ROWS):
                    r = r0 + offs_r  # the pool's row order: token-major, then head
                    t = r // HEADS
                    h = r - t * HEADS
                    if HEAD == HEAD_P and (TOKENS * HEADS) % ROWS == 0:
                        mask = None  # no mask where none is needed: nothing in the way of 16-byte accesses
                    else:
                        mask = (r < TOKENS * HEADS)[:, None] & (offs_d < HEAD)[None, :]
                    v_rows = (v_block + t.to(tl.int64) * v_st + h.to(tl.int64) * v_sh)[:, None] + offs_d[None, :]
                    p_rows = (p_block + t.to(tl.int64) * p_st + h.to(tl.int64) * p_sh)[:, None] + offs_d[None, :]
                    if INTO_VLLM:
                        k = tl.load(POOL + p_rows, mask=mask, eviction_policy=EVICT)
                        v = tl.load(POOL + p_skv + p_rows, mask=mask, eviction_policy=EVICT)
                        tl.store(VLLM + k_off + v_rows, k, mask=mask)
                        tl.store(VLLM + v_off + v_rows, v, mask=mask)
                    else:
                        k = tl.load(VLLM + k_off + v_rows, mask=mask, eviction_policy=EVICT)
                        v = tl.load(VLLM + v_off + v_rows, mask=mask, eviction_policy=EVICT)
                        tl.store(POOL + p_rows, k, mask=mask)
                        tl.store(POOL + p_skv + p_rows, v, mask=mask)


def layer_offsets(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Each view's address minus layer 0's K's, in elements: [k0, v0, k1, v1, ...] (k0 = 0)."""
    base, size = layers[0][0].data_ptr(), layers[0][0].element_size()
    offsets = []
    for k, v in layers:
        for view in (k, v):
            delta = view.data_ptr() - base
            if delta % size:
                raise ValueError("a vLLM KV cache view is not aligned to its element size")
            offsets.append(delta // size)
    return offsets


def common_alignment(offsets: list[int], element_size: int) -> int:
    """The largest power of two, at most 16 bytes' worth of elements, that divides every offset."""
    align = max(1, 16 // element_size)
    while align > 1 and any(o % align for o in offsets):
        align //= 2
    return align


class BlockCopier:
    """The copy plan of one set of vLLM views (``register_kv_caches``): their layer offset table, made once.

    ``path`` says which path the last ``copy`` took: "triton" (one kernel launch) or "torch (<why>)"."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], *, kernel_on_cpu: bool = False,
                 config: CopyConfig | None = None) -> None:
        if not layers:
            raise ValueError("no vLLM KV cache views to copy")
        self.layers = layers
        self.kernel_on_cpu = kernel_on_cpu  # the kernel on CPU tensors too: for Triton's interpreter (the tests)
        self.config = config or DEFAULT  # DEFAULT as it is when the copier is made (a benchmark may set it)
        self.path = ""
        self.word = 0  # the bytes of the integers the last kernel copy moved
        self.direct = True  # False once this Triton refused a direct launch of its compiled kernel (then the JIT's)
        self.ids: IdStages | None = None  # made at the first CUDA kernel copy
        self._refusal = self._views_refusal()
        self._offset_bytes: list[int] = []
        self._tables: dict[int, tuple[torch.Tensor, int]] = {}  # word -> (offset table in words, its alignment)
        self._launch: tuple[torch.Tensor, KernelLaunch | str] | None = None  # the last pool tensor, its launch or refusal
        self._vllm_blocks = int(layers[0][0].shape[0])
        self._hooks = getattr(getattr(triton, "knobs", None), "runtime", None)  # Triton's launch hooks (3.4+)
        if self._refusal is None:
            self._offset_bytes = [o * layers[0][0].element_size() for o in layer_offsets(layers)]

    def _views_refusal(self) -> str | None:
        k0 = self.layers[0][0]
        if triton is None:
            return "Triton is not installed"
        if not (k0.is_cuda or self.kernel_on_cpu):
            return f"vLLM's KV cache is on {k0.device.type}"
        if k0.stride(3) != 1:
            return f"vLLM's head dimension is strided ({tuple(k0.stride())})"
        for k, v in self.layers:
            for view in (k, v):
                if view.stride() != k0.stride() or view.shape != k0.shape or view.dtype != k0.dtype:
                    return "vLLM's per-layer views differ in shape, strides or dtype"
                if view.device != k0.device:
                    return "vLLM's per-layer views are on different devices"
        return None

    def kernel_refusal(self, pool: torch.Tensor) -> str | None:
        """Why the kernel cannot copy between these views and ``pool`` (None: it can)."""
        if self._refusal is not None:
            return self._refusal
        k0 = self.layers[0][0]
        if pool.device != k0.device:
            return f"the pool is on {pool.device}, vLLM's KV cache on {k0.device}"
        if pool.dtype != k0.dtype:
            return f"the pool holds {pool.dtype}, vLLM's KV cache {k0.dtype}"
        if pool.dim() != 6 or tuple(pool.shape[1:]) != (len(self.layers), 2, *k0.shape[1:]):
            return f"the pool's shape {tuple(pool.shape)} is not [blocks, layers, 2, {', '.join(map(str, k0.shape[1:]))}]"
        if pool.stride(5) != 1:
            return "the pool's head dimension is strided"
        if k0.element_size() not in INT_OF_SIZE:
            return f"an element of {k0.element_size()} bytes"
        return None

    def copy(self, pool: torch.Tensor, pool_ids: Sequence[int] | np.ndarray, vllm_ids: Sequence[int] | np.ndarray, *,
             into_vllm: bool) -> None:
        self.copy_pairs(pool, pair_ids(pool_ids, vllm_ids, int(pool.shape[0]), self._vllm_blocks), into_vllm=into_vllm)

    def copy_pairs(self, pool: torch.Tensor, pairs: np.ndarray, *, into_vllm: bool) -> None:
        """``copy`` of the pairs as one int64 array [2, n] (``pair_ids``, ``metadata.pairs_of``): the kernel is
        launched after a bounds check, a stage upload and nothing else of Python per id."""
        launch = self._launch_of(pool)
        kernel = isinstance(launch, KernelLaunch)
        check_pairs(pairs, launch.pool_blocks if kernel else int(pool.shape[0]), self._vllm_blocks)  # type: ignore[union-attr]
        if not pairs.shape[1]:
            return
        if kernel:
            self._kernel_copy(launch, pairs, into_vllm)  # type: ignore[arg-type]
            self.path = "triton"
        else:
            _torch_copy(self.layers, pool, pairs[0], pairs[1], into_vllm)
            self.path = f"torch ({launch})"

    def _launch_of(self, pool: torch.Tensor) -> KernelLaunch | str:
        """The kernel's arguments for ``pool`` (or why the kernel refuses it), worked out again only for another
        pool tensor object (the copier keeps the last one: its address, shape and strides are the launch's; a
        pool tensor is never resized in place): vLLM's side is fixed for the copier."""
        if self._launch is None or self._launch[0] is not pool:
            refusal = self.kernel_refusal(pool)
            self._launch = (pool, refusal if refusal is not None else self._plan_launch(pool))
        return self._launch[1]

    def _widest_word(self, pool: torch.Tensor) -> int:
        k0 = self.layers[0][0]
        size = k0.element_size()
        parts = [k0.shape[3] * size, k0.data_ptr(), pool.data_ptr(), *self._offset_bytes,
                 *(st * size for st in k0.stride()[:3]), *(st * size for st in pool.stride()[:5])]
        word = max(size, self.config.word_bytes)
        while word > size and any(part % word for part in parts):
            word //= 2
        return word

    def _table(self, word: int) -> tuple[torch.Tensor, int]:
        if word not in self._tables:
            offsets = [o // word for o in self._offset_bytes]
            self._tables[word] = (torch.tensor(offsets, dtype=torch.int64, device=self.layers[0][0].device),
                                  common_alignment(offsets, word))
        return self._tables[word]

    def _plan_launch(self, pool: torch.Tensor) -> KernelLaunch:
        k0, cfg = self.layers[0][0], self.config
        word = self._widest_word(pool)
        per = word // k0.element_size()  # elements a word
        offsets, align = self._table(word)
        _, tokens, heads, head = k0.shape
        head_w = head // per
        head_p = triton.next_power_of_2(head_w)
        rows = max(1, min(cfg.tile_bytes // (head_p * word), triton.next_power_of_2(tokens * heads)))
        as_int = INT_OF_SIZE[word]
        strides = (*(st // per for st in k0.stride()[:3]), *(st // per for st in pool.stride()[:5]))
        constants = dict(TOKENS=tokens, HEADS=heads, HEAD=head_w, HEAD_P=head_p, ROWS=rows, ALIGN=align,
                         BLOCKS_PER_PROGRAM=cfg.blocks_per_program,
                         EVICT="evict_first" if cfg.evict_first else "", num_warps=cfg.num_warps)
        vllm, pool_w = k0.view(as_int), pool.view(as_int)
        return KernelLaunch(vllm, pool_w, offsets, strides, constants, word, k0.device.index if k0.is_cuda else None,
                            {}, int(pool.shape[0]), (vllm.data_ptr(), pool_w.data_ptr(), offsets.data_ptr()))

    def _kernel_copy(self, launch: KernelLaunch, pairs: np.ndarray, into_vllm: bool) -> None:
        n = pairs.shape[1]
        grid = (-(-n // self.config.blocks_per_program), len(self.layers), 1)  # 3: as compiled[grid] wants
        self.word = launch.word
        if launch.device is None:  # Triton's interpreter (the tests): the array as it is, through the JIT
            self._jit_launch(launch, grid, torch.from_numpy(pairs.reshape(-1)), n, into_vllm)
            return
        switch = torch._C._cuda_getDevice() != launch.device  # a vLLM worker: never
        with torch.cuda.device(launch.device) if switch else contextlib.nullcontext():  # the views' device
            ids = self.ids = self.ids or IdStages(self.layers[0][0].device)
            address = ids.put(pairs)
            try:
                raw = launch.compiled.get(into_vllm)
                if raw is None or not self._raw_launch(raw, launch, grid, address, n, into_vllm):
                    self._jit_launch(launch, grid, ids.tensor(), n, into_vllm)
            finally:
                ids.read()

    def _raw_launch(self, raw: RawLaunch, launch: KernelLaunch, grid: tuple[int, int, int], ids: int, n: int,
                    into_vllm: bool) -> bool:
        """The compiled kernel through its launcher (False: this Triton's launcher takes other arguments; then and
        from now on the JIT's)."""
        hooks = self._hooks
        try:
            enter, leave = (hooks.launch_enter_hook, hooks.launch_exit_hook) if hooks is not None else (None, None)
            if unhooked(enter) and unhooked(leave):
                raw.run(grid[0], grid[1], grid[2], self.ids.stream, raw.function, raw.packed,  # type: ignore[union-attr]
                        None, None, None, *launch.pointers, ids, n, *raw.tail)
            else:  # a profiler's hooks: Triton's own per-call path, which gives them their metadata
                raw.kernel[grid](*launch.pointers, ids, n, *raw.tail)
            return True
        except (TypeError, IndexError, AttributeError):
            launch.compiled[into_vllm] = None
            self.direct = False
            return False

    def _jit_launch(self, launch: KernelLaunch, grid: tuple[int, int, int], ids: torch.Tensor, n: int,
                    into_vllm: bool) -> None:
        kernel = _block_copy_kernel[grid](launch.vllm, launch.pool, launch.offsets, ids, n, *launch.strides,
                                          INTO_VLLM=into_vllm, **launch.constants)
        if self.direct and self.config.direct_launch and all(
                hasattr(kernel, name) for name in ("run", "function", "packed_metadata")):
            launch.compiled[into_vllm] = RawLaunch(kernel.run, kernel.function, kernel.packed_metadata,
                                                   (*launch.strides, *launch.constexpr_values(into_vllm)), kernel)


def unhooked(hook: Any) -> bool:
    """No launch hook: None, or Triton's empty ``HookChain`` (the default of Triton 3.6 and later: never None)."""
    return hook is None or not getattr(hook, "calls", True)


def _torch_copy(layers: list[tuple[torch.Tensor, torch.Tensor]], pool: torch.Tensor, pool_ids: Sequence[int] | np.ndarray,
                vllm_ids: Sequence[int] | np.ndarray, into_vllm: bool) -> None:
    """Per layer advanced indexing: the CPU backend's path, and the fallback for what the kernel refuses."""
    device = layers[0][0].device
    p_ids = torch.as_tensor(np.asarray(pool_ids, dtype=np.int64), device=pool.device)
    v_ids = torch.as_tensor(np.asarray(vllm_ids, dtype=np.int64), device=device)
    if into_vllm:
        blocks = pool.index_select(0, p_ids).to(device)  # [n, L, 2, B, H, D]: every layer at once
        for layer, (k, v) in enumerate(layers):
            k[v_ids] = blocks[:, layer, 0]
            v[v_ids] = blocks[:, layer, 1]
    else:  # gathered from vLLM's layout and scattered into the pool's, layer by layer: no staging copy
        for layer, (k, v) in enumerate(layers):
            pool[:, layer, 0].index_copy_(0, p_ids, k.index_select(0, v_ids).to(pool.device))
            pool[:, layer, 1].index_copy_(0, p_ids, v.index_select(0, v_ids).to(pool.device))

