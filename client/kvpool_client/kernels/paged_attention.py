"""Attention that reads K and V straight out of the pool, through block tables (PyTorch tensors in and out).

``k_cache``/``v_cache`` are one layer's ``[num_blocks, block_size, num_kv_heads, head_dim]`` views of the pool
(``torch_views.layer_kv``; any strides -- the block-major pool's block stride is the whole block's bytes)::

    decode:  q [B, Hq, D]  x  block_tables int32 [B, max_blocks], seq_lens int32 [B]  ->  out [B, Hq, D]
             GQA: query head h reads KV head h // (Hq // Hkv); fp16 or bf16; any block size

On CUDA the decode is a Triton kernel (flash-decoding): one program per (sequence, KV head, split of the context)
handles all ``Hq // Hkv`` query heads of that KV head, so each K/V byte is read once; it walks the context
``BLOCK_N`` tokens at a time, looking each token's block up in the table (so the tile need not match the block
size), with an online softmax in float32. With several splits a second kernel merges the partial results by their
log-sum-exp. On the CPU the same function is computed by PyTorch (gather + matmul in float32).

Prefill (several query tokens of one sequence) has no kernel of its own: ``paged_prefill_attention`` gathers the
sequence's context from the pool and runs PyTorch's SDPA with a causal mask offset to the query's positions.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path below still works
    triton = None


if triton is not None:

    @triton.jit
    def _decode_kernel(Q, K, V, BT, SL, O, MO, ML, scale_log2,
                       stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                       stride_bt, stride_ob, stride_oh, block_size, tokens_per_split,
                       GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(SL + b)
        start = split * tokens_per_split
        end = tl.minimum(seq_len, start + tokens_per_split)
        offs_g = tl.arange(0, GROUP_P)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g
        q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
        for t0 in range(start, end, BLOCK_N):
            t = t0 + offs_n
            t_mask = t < end
            page = t // block_size
            blk = tl.load(BT + b.to(tl.int64) * stride_bt + page, mask=t_mask, other=0).to(tl.int64)
            off = (t - page * block_size).to(tl.int64)
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(K + blk[:, None] * stride_kb + off[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(V + blk[:, None] * stride_vb + off[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2  # [GROUP_P, BLOCK_N], log2 units
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLIT:
            has = l_i > 0
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            part = acc / tl.where(has, l_i, 1.0)[:, None]
            row = (b.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split
            tl.store(MO + row[:, None] * HEAD_DIM + offs_d[None, :], part, mask=g_mask[:, None] & d_mask[None, :])
            tl.store(ML + row, lse, mask=g_mask)
        else:
            out = acc / l_i[:, None]
            tl.store(O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(O.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])

    @triton.jit
    def _merge_kernel(MO, ML, O, stride_ob, stride_oh, num_heads, NUM_SPLITS: tl.constexpr,
                      SPLITS_P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_P)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < NUM_SPLITS
        row = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS + offs_s
        lse = tl.load(ML + row, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp2(lse - m)
        parts = tl.load(MO + row[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
        tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty),
                 mask=offs_d < HEAD_DIM)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [B, Hq, D] and the caches [num_blocks, block_size, Hkv, D], got {tuple(q.shape)},"
                         f" {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"head_dim must match and Hq ({q.shape[1]}) be a multiple of Hkv ({k_cache.shape[2]})")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"q and the caches must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or tuple(seq_lens.shape) != (q.shape[0],):
        raise ValueError("block_tables must be [B, max_blocks] and seq_lens [B]")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None, *,
                           out: torch.Tensor | None = None, num_splits: int | None = None, block_n: int = 64,
                           num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged context (see the module docstring).

    Runs on the tensors' device, enqueued on PyTorch's current stream. ``seq_lens[b] >= 1`` and
    ``block_tables[b, :ceil(seq_lens[b] / block_size)]`` must name valid blocks (not checked on the device)."""
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not q.is_cuda:
        return _decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if triton is None:
        raise RuntimeError("paged_decode_attention on CUDA needs Triton")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("head_dim must be the contiguous dimension of q and the caches")
    block_tables = block_tables.to(torch.int32) if block_tables.dtype != torch.int32 else block_tables
    seq_lens = seq_lens.to(torch.int32) if seq_lens.dtype != torch.int32 else seq_lens
    out = torch.empty_like(q) if out is None else out
    max_len = block_tables.shape[1] * block_size
    if num_splits is None:  # split the context only while (sequence, KV head) programs leave SMs idle
        programs = batch * num_kv_heads
        sms = _multi_processors(q.device)
        num_splits = 1 if programs >= sms else max(1, min(-(-sms // programs), -(-max_len // block_n)))
    tokens_per_split = -(-max_len // num_splits)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n
    num_splits = -(-max_len // tokens_per_split)
    group_p = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    if split:
        mid_o = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        mid_l = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_l = out
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_o, mid_l, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), block_size, tokens_per_split,
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, SPLIT=split,
        num_warps=num_warps, num_stages=num_stages)
    if split:
        _merge_kernel[(batch, num_heads)](mid_o, mid_l, out, out.stride(0), out.stride(1), num_heads,
                                          NUM_SPLITS=num_splits, SPLITS_P=triton.next_power_of_2(num_splits),
                                          HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=4)
    return out


_SMS: dict[torch.device, int] = {}


def _multi_processors(device: torch.device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Tokens [0, seq_len) of one sequence from a paged cache, as a dense [seq_len, H, D] copy."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    blocks = block_table.to(cache.device, torch.int64)[positions // block_size]
    return cache[blocks, positions % block_size]


def _decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b, seq_len in enumerate(seq_lens.tolist()):
        k = gather_context(k_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        v = gather_context(v_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[b].float(), k) * scale
        out[b] = torch.einsum("hk,khd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_len: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention of one sequence's last ``Sq`` tokens (``q`` [Sq, Hq, D]) over its first ``seq_len`` tokens
    in the pool (those ``Sq`` included, already written). The documented fallback: gather, then PyTorch SDPA."""
    sq, num_heads, _ = q.shape
    k = gather_context(k_cache, block_table, seq_len)
    v = gather_context(v_cache, block_table, seq_len)
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    allowed = (torch.arange(seq_len, device=q.device)[None, :]
               <= (seq_len - sq + torch.arange(sq, device=q.device))[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)
