"""The attached pool as PyTorch tensors, zero-copy: what paged-attention kernels (ours, vLLM's, FlashInfer's) read.

    blocks(pool)          [num_blocks, L, 2, block_size, H, D]   CUDA tensor (GPU pool, via CUDA array interface)
                                                                 or CPU tensor (host pool, via NumPy)
    layer_kv(pool, l)     K, V of layer l, each [num_blocks, block_size, H, D], block stride = block_bytes

bfloat16 pools are stored as 16-bit patterns; the views here are ``torch.bfloat16`` (reinterpreted, not converted).
The tensors borrow the mapping: do not use them after ``pool.close()``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def blocks(pool: Any) -> torch.Tensor:
    raw = pool.blocks
    dtype = pool.layout.dtype
    if isinstance(raw, np.ndarray):
        t = torch.from_numpy(raw.view(np.int16) if dtype == "bfloat16" else raw)
    else:
        t = torch.as_tensor(raw.view("int16") if dtype == "bfloat16" else raw, device=f"cuda:{raw.device.id}")
    return t.view(_TORCH[dtype]) if dtype == "bfloat16" else t


def layer_kv(pool: Any, layer: int, whole: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    t = blocks(pool) if whole is None else whole
    return t[:, layer, 0], t[:, layer, 1]


def torch_dtype(layout: Any) -> torch.dtype:
    return _TORCH[layout.dtype]
