"""The block-copy kernel's tuning (``CopyConfig``), what a launch of it passes (``KernelLaunch``), and the way the
copy's block ids reach the device (``IdStages``).

All belong to ``block_copy.BlockCopier``: the config picks the kernel variant (constexpr parameters of its one
definition), the launch holds its arguments for one pool tensor, the stages carry every copy's ids up without an
allocation or a wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch


@dataclass(frozen=True)
class CopyConfig:
    """One variant of the block-copy kernel.

    tile_bytes: bytes of one K (and one V) tile a program moves per step (rounded down to a power of two of rows).
    num_warps: the launch's warps a program.
    blocks_per_program: block pairs (of one layer) a program copies one after the other (fewer, longer programs).
    word_bytes: the widest integer the bytes are moved as (2, 4 or 8; never narrower than an element): a wider
        word where the head's bytes, every stride and every layer offset divide by it -- fewer addresses a tile.
    evict_first: ``eviction_policy="evict_first"`` on the loads (each byte is read once).
    direct_launch: a copy after the first launches the kernel Triton compiled for it, not through the JIT.

    Invariant: every field is a power of two or a count; the kernel's bytes do not depend on any of them (the tests
    check each combination byte for byte)."""

    tile_bytes: int = 16384
    num_warps: int = 4
    blocks_per_program: int = 1
    word_bytes: int = 2
    evict_first: bool = False
    direct_launch: bool = True

    def label(self) -> str:
        return (f"tile {self.tile_bytes:6d} B  warps {self.num_warps:2d}  blocks/prog {self.blocks_per_program}  "
                f"word {self.word_bytes}  evict {'first' if self.evict_first else 'none '}"
                f"{'' if self.direct_launch else '  JIT launch'}")


class KernelLaunch(NamedTuple):
    """What every kernel copy between one pool tensor and the copier's views passes (``block_copy.BlockCopier._launch_of``):
    both sides as integers of ``word`` bytes, the layer offset table, the strides in words, the constexprs; and
    the kernel Triton compiled for them, by direction, once the first copy made it (``compiled``): the copies after
    it call its launcher directly (``RawLaunch``), without the JIT's dispatch (binding, specialisation key, cache
    lookup) -- sound because nothing that varies between copies (the ids, their count) is specialised on."""

    vllm: torch.Tensor
    pool: torch.Tensor
    offsets: torch.Tensor
    strides: tuple[int, ...]
    constants: dict[str, Any]
    word: int
    device: int | None  # the views' CUDA device (None: CPU tensors, the interpreter)
    compiled: dict[bool, Any]  # into_vllm -> its RawLaunch (None: launch through the JIT)
    pool_blocks: int  # the pool's block count (the ids' bound)
    pointers: tuple[int, int, int]  # vllm's, pool's and offsets' addresses, as a raw launch passes them

    def constexpr_values(self, into_vllm: bool) -> tuple[Any, ...]:
        """The kernel's constexpr arguments in its signature's order (``num_warps`` is an option, not one)."""
        c = self.constants
        return (c["TOKENS"], c["HEADS"], c["HEAD"], c["HEAD_P"], c["ROWS"], c["ALIGN"], into_vllm,
                c["BLOCKS_PER_PROGRAM"], c["EVICT"])


class RawLaunch(NamedTuple):
    """One direction's compiled kernel as its launcher takes it (Triton 3.3+: ``CompiledKernel.run`` with the grid,
    the raw stream, the function handle, the packed metadata, the launch hooks, then every argument, pointers as
    ints): what ``compiled[grid](*args)`` does per call, its constant parts looked up once. ``tail``: the strides
    and the constexprs, after the ids and their count; ``kernel``: the compiled kernel itself (its ``[grid]`` path
    where a profiler set Triton's launch hooks)."""

    run: Any
    function: Any
    packed: Any
    tail: tuple[Any, ...]
    kernel: Any


class IdStages:
    """A copy's ids on its device as the kernel reads them: one int64 vector ``[pool ids..., vLLM ids...]`` (2n),
    uploaded through one of two stages taken in turn -- a pinned host buffer and a device buffer of the same size
    (16 bytes a pair, the largest copy's so far; never shrunk) -- as one copy queued on the current stream.

    ``put(pairs)`` fills the next stage, queues its upload and returns the device buffer's address (``tensor()``:
    the same as a tensor); the caller launches the copy that reads it, then ``read()`` records the stage's event on
    the stream. With CuPy (which a GPU pool's ``attach`` needs) the upload and the events are CUDA runtime calls
    on the raw stream -- a microsecond or two each, against 5-10 us for PyTorch's; without it, PyTorch's. Invariant:
    a stage is written (host buffer, then device buffer) only once the copy that last read it has run (its event)
    -- as a rule long since, two copies ago -- so no upload races a kernel still reading, whatever stream either
    is on; a buffer is replaced by a larger one only then too (its upload and its reader done)."""

    STAGES = 2

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._host: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64) for _ in range(self.STAGES)]
        self._device: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64, device=device) for _ in range(self.STAGES)]
        self._host_np: list[np.ndarray] = [t.numpy() for t in self._host]
        self._size = 0
        self._turn = 0
        self.uploads = 0
        self.stream = 0  # the raw stream of the last put
        try:
            import cupy.cuda.runtime as rt  # noqa: PLC0415  (a GPU pool's attach needs CuPy anyway)

            with rt_device(rt, self._index):
                self._events: list[Any] = [rt.eventCreateWithFlags(2) for _ in range(self.STAGES)]  # DisableTiming
            self._rt: Any = rt
        except ImportError:
            self._rt = None
            self._events = [torch.cuda.Event() for _ in range(self.STAGES)]

    def put(self, pairs: np.ndarray) -> int:
        """``pairs`` (int64 [2, n]) as a device vector of 2n (its address), its upload queued on the current stream."""
        k = self._turn = (self._turn + 1) % self.STAGES
        size = self._size = pairs.size
        rt = self._rt
        if rt is not None:
            rt.eventSynchronize(self._events[k])  # the copy that last read this stage has run (at once if none did)
        else:
            self._events[k].synchronize()
        if self._host[k].numel() < size:  # larger ones, only now: the old stage's upload and reader have run
            self._host[k] = torch.empty(max(size, 512), dtype=torch.int64, pin_memory=True)
            self._device[k] = torch.empty(max(size, 512), dtype=torch.int64, device=self.device)
            self._host_np[k] = self._host[k].numpy()
        self._host_np[k][:size] = pairs.reshape(-1)
        self.stream = torch._C._cuda_getCurrentRawStream(self._index)
        if rt is not None:
            rt.memcpyAsync(self._device[k].data_ptr(), self._host[k].data_ptr(), 8 * size, 1, self.stream)  # H2D
        else:
            self._device[k][:size].copy_(self._host[k][:size], non_blocking=True)
        self.uploads += 1
        return self._device[k].data_ptr()

    def tensor(self) -> torch.Tensor:
        """The stage ``put`` last filled, as a tensor of its 2n ids."""
        return self._device[self._turn][: self._size]

    def read(self) -> None:
        """The copy that reads the stage ``put`` last filled is queued: its event, on the same stream."""
        if self._rt is not None:
            self._rt.eventRecord(self._events[self._turn], self.stream)
        else:
            self._events[self._turn].record(torch.cuda.current_stream(self._index))

    def __del__(self) -> None:
        rt = getattr(self, "_rt", None)
        if rt is not None:
            for event in self._events:
                with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
                    rt.eventDestroy(event)


@contextlib.contextmanager
def rt_device(rt: Any, index: int) -> Iterator[None]:
    """The CUDA runtime's current device set to ``index`` for the block (the one before restored)."""
    before = rt.getDevice()
    if before != index:
        rt.setDevice(index)
    try:
        yield
    finally:
        if before != index:
            rt.setDevice(before)
