"""The block-copy kernel's tuning (``CopyConfig``) and the copy's block ids kept on the device (``DeviceIds``).

Both belong to ``block_copy.BlockCopier``: the config picks the kernel variant (constexpr parameters of its one
definition), the id cache spares a repeated copy (the same pairs again, the benchmarks) its host-to-device upload.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

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
    ids_cache: distinct (pool ids, vLLM ids) arrays kept on the device (0: every copy uploads its ids).
    direct_launch: a copy after the first launches the kernel Triton compiled for it, not through the JIT.

    Invariant: every field is a power of two or a count; the kernel's bytes do not depend on any of them (the tests
    check each combination byte for byte)."""

    tile_bytes: int = 16384
    num_warps: int = 4
    blocks_per_program: int = 1
    word_bytes: int = 2
    evict_first: bool = False
    ids_cache: int = 8
    direct_launch: bool = True

    def label(self) -> str:
        return (f"tile {self.tile_bytes:6d} B  warps {self.num_warps:2d}  blocks/prog {self.blocks_per_program}  "
                f"word {self.word_bytes}  evict {'first' if self.evict_first else 'none '}  ids_cache {self.ids_cache}"
                f"{'' if self.direct_launch else '  JIT launch'}")


class DeviceIds:
    """The copy's ids as one device tensor [2, n] (row 0 the pool's, row 1 vLLM's), the last ``size`` distinct
    arrays kept (least recently used dropped), found by their bytes. A new array goes up through one of two pinned
    staging buffers, taken in turn and reused (16 bytes a pair, the largest copy's, never shrunk), as one copy
    queued on the stream: a step's load and store do not wait for each other's upload. Invariants: a kept tensor is
    never written after its upload, so a kernel still reading it is never raced; a stage is written only once the
    last upload from it has run (its event)."""

    STAGES = 2

    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # the ids' bytes -> their tensor
        self._stages: list[tuple[torch.Tensor, Any]] = []  # (pinned int64 of 2 x capacity, its last upload's event)
        self._turn = 0
        self.uploads = 0

    def get(self, pairs: np.ndarray, device: torch.device) -> torch.Tensor:
        """``pairs`` (int64 [2, n]) on ``device``: the kept tensor of the same ids, else one upload."""
        key = pairs.tobytes() if self.size else b""
        ids = self._kept.get(key) if self.size else None
        if ids is not None:
            self._kept.move_to_end(key)
            return ids
        ids = self._upload(pairs, device) if device.type == "cuda" else torch.from_numpy(pairs)
        self.uploads += 1
        if self.size:
            self._kept[key] = ids
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return ids

    def _upload(self, pairs: np.ndarray, device: torch.device) -> torch.Tensor:
        n, self._turn = pairs.shape[1], (self._turn + 1) % self.STAGES
        if len(self._stages) < self.STAGES:
            self._stages.append((torch.empty(0, dtype=torch.int64), torch.cuda.Event()))
        stage, uploaded = self._stages[self._turn]
        if stage.numel() < 2 * n:  # a larger one; the old is freed by torch once its upload has run
            stage = torch.empty(2 * max(n, 256), dtype=torch.int64, pin_memory=True)
            self._stages[self._turn] = (stage, uploaded)
        uploaded.synchronize()  # this stage's last upload has run (long since, as a rule; at once if none)
        staged = stage[: 2 * n]
        staged.numpy().reshape(2, n)[...] = pairs
        ids = torch.empty((2, n), dtype=torch.int64, device=device)
        ids.view(-1).copy_(staged, non_blocking=True)
        uploaded.record()
        return ids
