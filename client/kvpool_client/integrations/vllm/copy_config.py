"""The block-copy kernel's tuning (``CopyConfig``) and the copy's block ids kept on the device (``DeviceIds``).

Both belong to ``block_copy.BlockCopier``: the config picks the kernel variant (constexpr parameters of its one
definition), the id cache spares a repeated copy (the same pairs again, the benchmarks) its host-to-device upload.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

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

    Invariant: every field is a power of two or a count; the kernel's bytes do not depend on any of them (the tests
    check each combination byte for byte)."""

    tile_bytes: int = 16384
    num_warps: int = 4
    blocks_per_program: int = 1
    word_bytes: int = 2
    evict_first: bool = False
    ids_cache: int = 8

    def label(self) -> str:
        return (f"tile {self.tile_bytes:6d} B  warps {self.num_warps:2d}  blocks/prog {self.blocks_per_program}  "
                f"word {self.word_bytes}  evict {'first' if self.evict_first else 'none '}  ids_cache {self.ids_cache}")


class DeviceIds:
    """The copy's ids as one device tensor [2, n] (row 0 the pool's, row 1 vLLM's), the last ``size`` distinct
    arrays kept (least recently used dropped). Invariant: a kept tensor is never written after its upload, so a
    kernel still reading it is never raced."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: OrderedDict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor] = OrderedDict()
        self.uploads = 0

    def get(self, pool_ids: list[int], vllm_ids: list[int], device: torch.device) -> torch.Tensor:
        key = (tuple(pool_ids), tuple(vllm_ids))
        ids = self._kept.get(key) if self.size else None
        if ids is not None:
            self._kept.move_to_end(key)
            return ids
        host = torch.from_numpy(np.array([pool_ids, vllm_ids], dtype=np.int64))  # 3x torch.tensor's speed
        if device.type == "cuda":  # pinned: the upload is queued on the stream, the host does not wait for it
            ids = host.pin_memory().to(device, non_blocking=True)
        else:
            ids = host.to(device)
        self.uploads += 1
        if self.size:
            self._kept[key] = ids
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return ids
