"""Split-KV prefill attention in one Triton kernel: a cache hit's suffix (``n`` new tokens) over its context, the
query heads that share a KV head taken together, the keys in pieces side by side, merged by log-sum-exp.

    o = pieces_attention(q, k, v, cu_own, pieces, scale)      q, o: [n, Hq, D]; k, v: [>= m, Hkv, D]

``cu_own = [p, m]`` (int32, on the device; ``split_kv.SplitPlan.cu_own``): the span's ``m`` keys, of which the
first ``p = m - n`` come before every query and the last ``n`` are the queries' own. One launch runs a program per
(block of queries, KV head, piece):

- a program's ``BLOCK_M`` rows are ``BLOCK_M / group`` queries times the ``group`` query heads of one KV head, so a
  tile of keys is read once for all of them (FlashAttention 2 reads it once per query head);
- pieces ``0 .. S - 1`` are the first ``p`` keys cut in ``S`` (piece ``s``: keys ``p s // S .. p (s + 1) // S``),
  piece ``S`` the own keys, causal (query ``i`` sees own keys ``0 .. i``); the bounds are read on the device, so a
  CUDA graph replays them with each prompt's lengths;
- each writes its partial output [S + 1, n, Hq, D] (the input's dtype) and log-sum-exp [Hq, S + 1, n] (float32;
  ``+inf``: a piece without keys), which ``split_kv.merge`` sums.

The online softmax runs in base 2 (scores times ``scale log2 e``), accumulators in float32, the products on the
tensor cores (``tl.dot``: wgmma on Hopper). Blocks whose keys every row sees run without a mask; only the causal
edge and a piece's last partial block are masked.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: split_kv's flash path or the math path
    triton = None

LOG2E = 1.0 / math.log(2.0)
# H200, 256 new tokens over 4,352 keys, with the merge, in a CUDA graph (bench_split_kv.py --variants): this config
# 58.2 us with 4 pieces, 54.3 with 2; 128 x 128 tiles, 2 stages 60.3 / 56.1; 64 x 64 tiles, 4 warps 54.7 / 50.8
# (not the default yet: its engine tests and TTFT not run); 128 x 64, 4 warps 92.7 / 87.4. The flash split: 102.3.
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}

if triton is not None:

    @triton.jit(do_not_specialize=["n"])
    def _pieces_kernel(Q, K, V, OUT, LSE, CU_OWN, n, qk_scale, q_row, k_row, v_row, HEADS: tl.constexpr, GROUP: tl.constexpr,
                       DIM: tl.constexpr, PIECES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        mb = tl.program_id(0)  # the block of BLOCK_M // GROUP queries
        kvh = tl.program_id(1)  # the KV head
        s = tl.program_id(2)  # the piece; PIECES: the own keys
        p = tl.load(CU_OWN)
        m = tl.load(CU_OWN + 1)
        own = s == PIECES
        lo = tl.where(own, p, p * s // PIECES)
        hi = tl.where(own, m, p * (s + 1) // PIECES)
        rows = tl.arange(0, BLOCK_M)
        first = mb * (BLOCK_M // GROUP)
        qi = first + rows // GROUP  # each row's query
        head = kvh * GROUP + rows % GROUP  # and query head
        d = tl.arange(0, DIM)
        row_ok = qi < n
        q = tl.load(Q + (qi * q_row + head * DIM)[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
        last = tl.minimum(first + BLOCK_M // GROUP, n) - 1  # the block's last real query
        # keys before ``full_hi`` are seen by every row (own piece: up to the block's first query's diagonal)
        full_hi = tl.where(own, tl.minimum(hi, p + first + 1), hi)
        edge_hi = tl.where(own, tl.minimum(hi, p + last + 1), hi)
        full_end = lo + (full_hi - lo) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM], tl.float32)
        cols = tl.arange(0, BLOCK_N)
        for start in range(lo, full_end, BLOCK_N):
            j = start + cols
            k_off = (j * k_row + kvh * DIM)[:, None] + d[None, :]
            v_off = (j * v_row + kvh * DIM)[:, None] + d[None, :]
            k = tl.load(K + k_off)
            qk = tl.dot(q, tl.trans(k)) * qk_scale
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            pr = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(pr, 1)
            v = tl.load(V + v_off)
            acc = tl.dot(pr.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        for start in range(full_end, edge_hi, BLOCK_N):
            j = start + cols
            j_ok = j < edge_hi
            k_off = (j * k_row + kvh * DIM)[:, None] + d[None, :]
            v_off = (j * v_row + kvh * DIM)[:, None] + d[None, :]
            k = tl.load(K + k_off, mask=j_ok[:, None], other=0.0)
            seen = j_ok[None, :] & (j[None, :] - p <= qi[:, None])  # a piece's keys (< p): every query's
            qk = tl.where(seen, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet (a padding row)
            pr = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(pr, 1)
            v = tl.load(V + v_off, mask=j_ok[:, None], other=0.0)
            acc = tl.dot(pr.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        some = l_i > 0.0
        out = acc / tl.where(some, l_i, 1.0)[:, None]
        tl.store(OUT + ((s * n + qi) * HEADS + head)[:, None] * DIM + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None])
        lse = tl.where(some, (m_i + tl.log2(tl.where(some, l_i, 1.0))) / 1.4426950408889634, float("inf"))
        tl.store(LSE + (head * (PIECES + 1) + s) * n + qi, lse, mask=row_ok)
else:
    _pieces_kernel = None


def supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``pieces_attention`` takes these tensors: Triton present, CUDA, fp16 / bf16, a power-of-two head size
    of 16..256, the query heads a multiple of the KV heads, contiguous rows."""
    dim = q.shape[-1]
    return (_pieces_kernel is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and k.dtype == q.dtype and 16 <= dim <= 256 and dim & (dim - 1) == 0 and q.shape[1] % k.shape[1] == 0
            and CONFIG["BLOCK_M"] % (q.shape[1] // k.shape[1]) == 0)


def pieces_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_own: torch.Tensor, pieces: int,
                     scale: float, config: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial attentions of ``q`` [n, Hq, D] over ``pieces`` pieces of the first ``cu_own[0]`` keys and the
    own keys ``cu_own[0] .. cu_own[1]`` of ``k``/``v`` [>= m, Hkv, D] (rows of any stride, heads and dims dense):
    (out [S + 1, n, Hq, D], lse [Hq, S + 1, n] float32). ``config``: tile sizes and launch options (``CONFIG``)."""
    cfg = dict(CONFIG if config is None else config)
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    q, k, v = (t if t.stride(2) == 1 and t.stride(1) == dim else t.contiguous() for t in (q, k, v))
    out = torch.empty(pieces + 1, n, heads, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(heads, pieces + 1, n, dtype=torch.float32, device=q.device)
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    grid = (triton.cdiv(n * group, block_m), k.shape[1], pieces + 1)
    _pieces_kernel[grid](q, k, v, out, lse, cu_own, n, scale * LOG2E, q.stride(0), k.stride(0), v.stride(0),
                         HEADS=heads, GROUP=group, DIM=dim, PIECES=pieces, BLOCK_M=block_m, BLOCK_N=block_n, **cfg)
    return out, lse
