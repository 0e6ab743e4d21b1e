"""The block-copy kernel's tuning (``CopyConfig``), what a launch of it passes (``KernelLaunch``), and the way the
copy's block ids reach the device (``IdStages``).

All belong to ``block_copy.BlockCopier``: the config picks the kernel variant (constexpr parameters of its one
definition), the launch holds its arguments for one pool tensor, the stages carry every copy's ids up without an
allocation or a wait.
"""

from __future__ import annotations

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
    it launch that directly, without the JIT's dispatch (binding, specialisation key, cache lookup) -- sound
    because nothing that varies between copies (the ids, their count) is specialised on."""

    vllm: torch.Tensor
    pool: torch.Tensor
    offsets: torch.Tensor
    strides: tuple[int, ...]
    constants: dict[str, Any]
    word: int
    device: int | None  # the views' CUDA device (None: CPU tensors, the interpreter)
    compiled: dict[bool, Any]  # into_vllm -> Triton's compiled kernel (None: launch through the JIT)

    def constexpr_values(self, into_vllm: bool) -> tuple[Any, ...]:
        """The kernel's constexpr arguments in its signature's order (``num_warps`` is an option, not one)."""
        c = self.constants
        return (c["TOKENS"], c["HEADS"], c["HEAD"], c["HEAD_P"], c["ROWS"], c["ALIGN"], into_vllm,
                c["BLOCKS_PER_PROGRAM"], c["EVICT"])


class IdStages:
    """A copy's ids on its device as the kernel reads them: one int64 vector ``[pool ids..., vLLM ids...]`` (2n),
    uploaded through one of two stages taken in turn -- a pinned host buffer and a device buffer of the same size
    (16 bytes a pair, the largest copy's so far; never shrunk) -- as one copy queued on the current stream.

    ``put(pairs)`` fills the next stage and queues its upload; the caller launches the copy that reads it, then
    ``read()`` records the stage's event on the stream. Invariant: a stage is written (host buffer, then device
    buffer) only once the copy that last read it has run (its event) -- as a rule long since, two copies ago -- so
    no upload races a kernel still reading, whatever stream either is on."""

    STAGES = 2

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._host: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64) for _ in range(self.STAGES)]
        self._device: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64, device=device) for _ in range(self.STAGES)]
        self._read = [torch.cuda.Event() for _ in range(self.STAGES)]
        self._turn = 0
        self.uploads = 0

    def put(self, pairs: np.ndarray) -> torch.Tensor:
        """``pairs`` (int64 [2, n]) as a device vector of 2n, its upload queued on the current stream."""
        k = self._turn = (self._turn + 1) % self.STAGES
        size = pairs.size
        self._read[k].synchronize()  # the copy that last read this stage has run (at once if none did)
        if self._host[k].numel() < size:  # larger ones; the old are freed by torch once their copies have run
            self._host[k] = torch.empty(max(size, 512), dtype=torch.int64, pin_memory=True)
            self._device[k] = torch.empty(max(size, 512), dtype=torch.int64, device=self.device)
        host, dev = self._host[k][:size], self._device[k][:size]
        host.numpy()[:] = pairs.reshape(-1)
        dev.copy_(host, non_blocking=True)
        self.uploads += 1
        return dev

    def read(self) -> None:
        """The copy that reads the stage ``put`` last filled is queued: its event, on the same stream."""
        self._read[self._turn].record(torch.cuda.current_stream(self._index))
