"""Split-KV for a prefill of few new tokens over a long context (a cache hit's suffix): the keys cut into pieces
that run side by side, their partial attentions merged by log-sum-exp.

    plan = split_plan(spans, num_heads, device)      None: one flash call fills the device already
    o = split_attention(q, k, v, spans, plan, scale)  o: [n, Hq, D], as the one flash call gives it

One varlen FlashAttention call runs a program per (128 queries, head): 256 new tokens of a 32-head model are 64
programs, half the H200's 132 multiprocessors, each walking the whole context. For one span of ``n`` new tokens
over ``m`` keys, the first ``p = m - n`` keys come before every query (each sees all of them) and the last ``n`` are the
queries' own (query i sees the first i + 1). So:

- the first ``p`` keys in ``S`` pieces, as ``S`` sequences of one non-causal varlen call, the ``n`` queries repeated
  for each (``cu_q = [0, n, .., S n]``, ``cu_k`` the pieces' bounds: ``p j // S``);
- the own keys by one causal call (``cu_k = [p, m]``: the call reads the keys from offset ``p``);
- the ``S + 1`` partial outputs merged in float32, each weighted by ``exp(lse_j - max lse)`` (``merge``: one
  Triton kernel on CUDA). A piece with no keys (``p < S``) has ``lse = +inf`` from the kernel and weight 0; the own
  keys are never empty.

The bounds are computed on the device from ``spans.cu_k`` (the CUDA graph of a prefill bucket replays them with
each prompt's lengths); ``n`` and the bucket's largest context are the plan's static sizes. ``S`` is chosen so the
two calls have at most two programs a multiprocessor, each piece at least ``MIN_PIECE_KEYS`` keys, at most
``MAX_PIECES`` (``pieces_for``). ``KVPOOL_ENGINE_SPLIT_KV=0`` turns it off (the benchmarks' same-run comparison).

Where Triton runs (CUDA, fp16 / bf16, a power-of-two head size), the pieces and the own keys are not the two flash
calls but one launch of ``split_kv_triton`` (the query heads of a KV head together: each tile of keys read once
for the group), merged the same way; the flash calls are its fallback (``KVPOOL_ENGINE_SPLIT_KV=flash`` forces
them; a Triton that fails to compile it falls back for good on that device).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from kvpool_client.kernels import split_kv_triton

MIN_PIECE_KEYS = 512
MAX_PIECES = 16
QUERY_BLOCK = 128  # the queries a flash program takes (FlashAttention 2, head size <= 128 on sm80/sm90)
PROGRAMS_PER_SM = 2
ENV = "KVPOOL_ENGINE_SPLIT_KV"
_triton_broken: set[str] = set()  # devices where split_kv_triton raised once


@dataclass(frozen=True)
class SplitPlan:
    """One span's pieces: ``pieces`` (S), ``cu_q`` [S + 1] (the repeated queries), ``cu_k`` [S + 1] (the pieces of
    the first ``p`` keys), ``cu_own`` [2] (= [p, m]), ``max_piece`` (an upper bound of a piece's keys), all int32
    on the device, made once per prefill and read by every layer."""

    pieces: int
    n: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    cu_own: torch.Tensor
    max_piece: int
    kernel: str = "flash"


@lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pieces_for(n: int, max_k: int, num_heads: int, sms: int) -> int:
    """How many pieces the first ``max_k - n`` keys are cut into (1: no split): as many as keep the two calls'
    programs within ``PROGRAMS_PER_SM`` a multiprocessor (rounded down: a partial wave costs a whole one), each
    piece at least ``MIN_PIECE_KEYS`` keys. H200 (``benchmarks/bench_split_kv.py``, in CUDA graphs): 256 new tokens x
    32 heads over 4,352 keys 1.24x with 4 pieces (1.06x with 5); 64 over 8,192 2.3x with 8."""
    programs = math.ceil(n / QUERY_BLOCK) * num_heads
    return max(1, min(MAX_PIECES, PROGRAMS_PER_SM * sms // programs, (max_k - n) // MIN_PIECE_KEYS))


def split_plan(spans: Any, num_heads: int, device: torch.device) -> SplitPlan | None:
    """The plan for ``spans`` (``prefill_attention.PrefillSpans``): one span only, on CUDA, when more than one
    piece pays; else None."""
    choice = os.environ.get(ENV, "1")
    if len(spans.spans) != 1 or device.type != "cuda" or choice == "0":
        return None
    pieces = pieces_for(spans.max_q, spans.max_k, num_heads, _multiprocessors(device))
    kernel = "triton" if split_kv_triton.triton is not None and choice != "flash" else "flash"
    return make_plan(spans.cu_k, spans.max_q, spans.max_k, pieces, kernel) if pieces >= 2 else None


def make_plan(cu_k: torch.Tensor, n: int, max_k: int, pieces: int, kernel: str = "flash") -> SplitPlan:
    """The plan of one span of ``n`` queries over ``cu_k[1]`` keys (at most ``max_k``) in ``pieces`` pieces, run by
    ``kernel`` ("flash": two varlen flash calls; "triton": ``split_kv_triton``'s one launch)."""
    cu_k = cu_k.to(torch.int32)
    p = cu_k[1:2] - n  # the keys before every query: on the device (a graph's spans carry each prompt's there)
    steps = torch.arange(pieces + 1, dtype=torch.int32, device=cu_k.device)
    bounds = torch.div(p * steps, pieces, rounding_mode="floor").to(torch.int32)
    return SplitPlan(pieces, n, steps * n, bounds, torch.cat([p, cu_k[1:2]]).to(torch.int32),
                     math.ceil((max_k - n) / pieces) + 1, kernel)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
           max_k: int, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One varlen FlashAttention call: (out [total_q, Hq, D], lse [Hq, total_q] float32)."""
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                       scale=scale)[:2]
    return out, lse


def _lse_by_piece(lse: torch.Tensor, heads: int, pieces: int, n: int) -> torch.Tensor:
    """The kernel's log-sum-exps as [Hq, pieces, n]: [Hq, total_q] (FlashAttention 2.4 on) or [batch, Hq, max_q]."""
    if lse.dim() == 2:
        return lse.view(heads, pieces, n)
    if lse.dim() == 3 and lse.shape[0] == pieces:
        return lse[:, :, :n].permute(1, 0, 2)
    raise RuntimeError(f"flash attention's log-sum-exp has the shape {tuple(lse.shape)}")


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SplitPlan,
                    scale: float) -> torch.Tensor:
    """The causal attention of one span's ``q`` [n, Hq, D] over ``k``/``v`` [m, Hkv, D] (bottom-right aligned),
    as ``plan`` splits it."""
    n, heads, dim = q.shape
    s = plan.pieces
    if plan.kernel == "triton" and split_kv_triton.supported(q, k) and str(q.device) not in _triton_broken:
        try:
            out, lse = split_kv_triton.pieces_attention(q, k, v, plan.cu_own, s, scale)
            return merge(out[:s].view(s * n, heads, dim), out[s], lse)
        except Exception as exc:  # noqa: BLE001  (a Triton build that cannot compile it: the flash calls from now on)
            _triton_broken.add(str(q.device))
            warnings.warn(f"split_kv_triton failed ({exc!r:.200}); the flash split from now on", stacklevel=2)
    o_pieces, lse_pieces = _flash(q.repeat(s, 1, 1), k, v, plan.cu_q, plan.cu_k, n, plan.max_piece, False, scale)
    o_own, lse_own = _flash(q, k, v, plan.cu_q[:2], plan.cu_own, n, n, True, scale)
    lse = torch.cat([_lse_by_piece(lse_pieces, heads, s, n), _lse_by_piece(lse_own, heads, 1, n)], dim=1)
    return merge(o_pieces, o_own, lse.contiguous())


def merge(o_pieces: torch.Tensor, o_own: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The pieces' outputs ``o_pieces`` [S n, Hq, D] and the own keys' ``o_own`` [n, Hq, D] weighted by their
    log-sum-exps ``lse`` [Hq, S + 1, n] (float32; +inf: a piece without keys, weight 0), in ``o_own``'s dtype. On
    CUDA one Triton kernel (a program per query and head: the S + 1 rows read once, summed in float32); elsewhere
    the same arithmetic in PyTorch."""
    if _merge_kernel is not None and (o_own.is_cuda or MERGE_ON_CPU):
        return _triton_merge(o_pieces, o_own, lse)
    n, heads, dim = o_own.shape
    pieces = lse.shape[1] - 1
    weights = torch.softmax(lse.masked_fill(lse == math.inf, -math.inf), dim=1)  # [Hq, S + 1, n]
    outs = torch.cat([o_pieces.view(pieces, n, heads, dim), o_own.view(1, n, heads, dim)])  # [S + 1, n, Hq, D]
    return torch.einsum("snhd,hsn->nhd", outs.float(), weights).to(o_own.dtype)


MERGE_ON_CPU = False  # the tests: the kernel on CPU tensors under Triton's interpreter

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch merge
    triton = None

if triton is not None:

    @triton.jit(do_not_specialize=["n"])
    def _merge_kernel(O_PIECES, O_OWN, LSE, OUT, n, PIECES: tl.constexpr, HEADS: tl.constexpr,
                      DIM: tl.constexpr, DIM_P: tl.constexpr):
        i = tl.program_id(0)  # the query
        h = tl.program_id(1)  # the head
        lse_row = LSE + h * (PIECES + 1) * n + i  # [Hq, S + 1, n]: piece s at lse_row + s * n, the own keys last
        top = tl.load(lse_row + PIECES * n)  # the own keys: never empty, finite
        for s in range(PIECES):
            lse = tl.load(lse_row + s * n)
            top = tl.maximum(top, tl.where(lse == float("inf"), float("-inf"), lse))
        offs = tl.arange(0, DIM_P)
        mask = offs < DIM
        row = (i * HEADS + h) * DIM  # [n, Hq, D] row of the own keys' output
        weight = tl.exp(tl.load(lse_row + PIECES * n) - top)
        acc = weight * tl.load(O_OWN + row + offs, mask=mask, other=0.0).to(tl.float32)
        total = weight
        for s in range(PIECES):
            lse = tl.load(lse_row + s * n)
            w = tl.where(lse == float("inf"), 0.0, tl.exp(lse - top))
            piece = tl.load(O_PIECES + s * n * HEADS * DIM + row + offs, mask=mask, other=0.0).to(tl.float32)
            acc += w * piece
            total += w
        tl.store(OUT + row + offs, (acc / total).to(OUT.dtype.element_ty), mask=mask)
else:
    _merge_kernel = None


def _triton_merge(o_pieces: torch.Tensor, o_own: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    n, heads, dim = o_own.shape
    o_pieces, o_own = o_pieces.contiguous(), o_own.contiguous()
    out = torch.empty_like(o_own)
    _merge_kernel[(n, heads)](o_pieces, o_own, lse, out, n, PIECES=lse.shape[1] - 1, HEADS=heads, DIM=dim,
                              DIM_P=triton.next_power_of_2(dim))
    return out
