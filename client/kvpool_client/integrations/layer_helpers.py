"""The elementwise parts of a Llama layer, three ways: eager, ``torch.compile``d, or Liger-Kernel's Triton kernels.

    f = helpers("liger")           # or "eager", "compile"
    x = f["rms_norm"](h, weight, eps)                   LlamaRMSNorm.forward
    h, x = f["add_rms_norm"](y, h, weight, eps)         h = y + h, then its RMSNorm
    q, k = f["rope"](q, k, cos, sin)                    q, k [T, H, D] (views allowed); cos, sin [T, 1, D]
    a = f["silu_mul"](gate_up)                          gate_up [T, 2I] (gate first) -> SiLU(gate) * up [T, I]

*eager* is written op for op as transformers computes it (~8, ~12 and 2 kernels). *compile* fuses each into one
kernel through Inductor (what nano-vllm does). *liger* (the default on CUDA when ``liger_kernel`` imports: pip
extra ``engine``) launches one Triton kernel of Liger-Kernel for each -- its "llama" casting mode rounds where
transformers rounds (the residual sum and the normalised row to the model's dtype before the weight; SiLU in
float32, rounded, then the product), its RoPE rotates ``q`` and ``k`` in place (the fused QKV output's views:
no copies) reading the left half of ``cos`` / ``sin`` (Llama's rotary repeats it), and each row is reduced by one program in one fixed order whatever the number of rows, so a prefill of 256
tokens and one of 4,352 normalise a row identically. A prefill replayed from a CUDA graph runs ~1,000 fewer
kernels with it (Llama-3-8B, 32 layers).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

NAMES = ("eager", "compile", "liger")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps)).to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return h, rms_norm(h, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return torch.nn.functional.silu(gate) * up


EAGER: dict[str, Callable] = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rope": rope, "silu_mul": silu_mul}
_SETS: dict[str, dict[str, Callable]] = {"eager": EAGER}


def _liger() -> dict[str, Callable]:
    from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward
    from liger_kernel.ops.rms_norm import rms_norm_forward
    import triton
    from liger_kernel.ops.rope import _triton_rope
    from liger_kernel.ops.swiglu import swiglu_fused_gate_up_forward

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_forward(x, weight, eps, 0.0, "llama", None)[0]

    def add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        normed, total = fused_add_rms_norm_forward(x, residual, weight, eps, 0.0, "llama")[:2]
        return total, normed

    def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Liger's RoPE kernel (what its rope_forward launches after copying q and k contiguous), on the views
        # themselves, in place: a program a token, heads ``head_dim`` apart, rows ``stride(0)`` apart
        t, hq, d = q.shape
        hkv = k.shape[1]
        if q.stride()[1:] != (d, 1) or k.stride()[1:] != (d, 1):
            q, k = q.contiguous(), k.contiguous()
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()  # [T, D]
        pad_q, pad_k, pad_d = triton.next_power_of_2(hq), triton.next_power_of_2(hkv), triton.next_power_of_2(d)
        _triton_rope[(t,)](q, q.stride(0), k, k.stride(0), cos, cos.stride(0), sin, sin.stride(0), t, 1, 1, hq, hkv,
                           d, pad_q, pad_k, pad_d, pad_d, d, BLOCK_SIZE=max(pad_q, pad_k), BACKWARD_PASS=False)
        return q, k

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu_fused_gate_up_forward(gate_up)[1]

    return {"rms_norm": norm, "add_rms_norm": add_norm, "rope": rotary, "silu_mul": act}


def helpers(name: str) -> dict[str, Callable]:
    """The helper set ``name`` (one of ``NAMES``); built once a process."""
    if name not in NAMES:
        raise ValueError(f"unknown elementwise helpers {name!r}: one of {', '.join(NAMES)}")
    if name not in _SETS:
        _SETS[name] = _liger() if name == "liger" else {n: torch.compile(fn, fullgraph=True)
                                                        for n, fn in EAGER.items()}
    return _SETS[name]


def liger_available() -> bool:
    try:
        import liger_kernel.ops.rope  # noqa: F401
    except Exception:  # noqa: BLE001  (not installed, or its Triton import failed)
        return False
    return True


def default_helpers(device: Any) -> str:
    """``KVPOOL_ENGINE_HELPERS`` if set; else on CUDA Liger's kernels when installed, else ``torch.compile``;
    eager elsewhere."""
    chosen = os.environ.get("KVPOOL_ENGINE_HELPERS")
    if chosen:
        return chosen
    if torch.device(device).type != "cuda":
        return "eager"
    return "liger" if liger_available() else "compile"
