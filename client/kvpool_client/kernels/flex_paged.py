"""PyTorch's FlexAttention reading K and V where they lie in the pool, through block tables: no gather, no copy.

FlexAttention takes K and V as ``[B, H, S, D]`` tensors and a block mask; it knows nothing of pages. The pool is
made to look like one long K (and one V) sequence whose "tokens" are the pool's rows, and the page table becomes
the mask::

    token_rows(k_cache)   one layer's K view [num_blocks, block_size, H, D]  ->  [1, H, R, D], a strided view
                          row r = b * P + o  is offset o of pool block b     (P: rows from one block to the next)
        layer-major:  P = block_size (the layer's K is contiguous): R = num_blocks * block_size, no gaps
        block-major:  P = 2 * num_layers * block_size: the rows in between are other layers' K/V, masked out

    paged_block_mask(block_tables, seq_lens, q_len, ...)
        mask_mod(b, h, q, r) = o < block_size  and  logical block of (b, r // P) >= 0
                               and  logical position (lblock * block_size + o) <= seq_len[b] - q_len + q
        sparse blocks: only the 128-row tiles holding a page of sequence b are visited (from the tables)

    out = flex_paged_attention(q, k_cache, v_cache, block_tables, seq_lens)     # decode: q [B, Hq, D]

So the layer-major layout is what FlexAttention (and vLLM/FlashInfer) read directly; block-major works too, at the
price of tiles that are mostly other layers' rows (each visited tile holds one page of 16 useful rows of 128).
The queries' batch is broadcast over K/V's batch of one; GQA by ``enable_gqa``. On CUDA the call is compiled
(``torch.compile(flex_attention)``, cached per shape); on the CPU it runs FlexAttention's eager reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

TILE = 128  # FlexAttention's sparse block (rows of K/V, and of queries, per mask tile)

_compiled: Any = None


def token_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One layer's K (or V) view ``[num_blocks, block_size, H, D]`` of the pool as ``[1, H, R, D]`` (no copy) and
    ``P``, the rows from one block to the next: token ``o`` of block ``b`` is row ``b * P + o``."""
    num_blocks, block_size, heads, dim = cache.shape
    sb, st, sh, sd = cache.stride()
    row = heads * dim
    if sd != 1 or sh != dim or st != row or sb % row:
        raise ValueError(f"a pool layer view has contiguous [block_size, H, D] rows and a block stride that is a "
                         f"multiple of H * D; got strides {cache.stride()}")
    per_block = sb // row
    rows = (num_blocks - 1) * per_block + block_size
    view = cache.as_strided((1, heads, rows, dim), (rows * row, dim, row, 1), cache.storage_offset())
    return view, per_block


def paged_block_mask(block_tables: torch.Tensor, seq_lens: torch.Tensor, q_len: int, *, num_blocks: int,
                     block_size: int, per_block: int, rows: int, kv_tile: int = TILE) -> BlockMask:
    """The block mask of causal attention of each sequence's last ``q_len`` tokens over its ``seq_lens[b]`` tokens,
    addressed as rows of ``token_rows``: ``block_tables`` int [B, max_blocks] (pool block of each logical block;
    entries past a sequence's blocks are ignored), ``seq_lens`` int [B]. ``kv_tile``: rows of K/V per mask tile
    (128, FlexAttention's default; 16 = one 16-token page, so no tile holds rows of other pages)."""
    device = block_tables.device
    tables = block_tables.to(torch.int64)
    lens = seq_lens.to(device=device, dtype=torch.int64)
    batch, width = tables.shape
    used = torch.arange(width, device=device)[None, :] < (-(-lens // block_size))[:, None]  # [B, W]
    # physical block -> logical block, per sequence (-1: not this sequence's)
    to_logical = torch.full((batch, num_blocks), -1, dtype=torch.int64, device=device)
    rows_b = torch.arange(batch, device=device)[:, None].expand(batch, width)
    to_logical[rows_b[used], tables[used]] = torch.arange(width, device=device)[None, :].expand(batch, width)[used]
    q_offset = lens - q_len  # query i sits at position q_offset + i

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        # int64 throughout: the compiled kernel's indices are int32, the tables int64, and Triton refuses a ternary
        # (the clamp) whose branches differ ("inconsistent types int64 and int32")
        kv, q = kv_idx.to(torch.int64), q_idx.to(torch.int64)
        blk = torch.clamp(kv // per_block, max=num_blocks - 1)  # rows past the pool (tile padding): masked
        off = kv - blk * per_block
        logical = to_logical[b, blk]
        pos = logical * block_size + off
        return (off < block_size) & (logical >= 0) & (pos <= q_offset[b] + q)

    # the KV tiles that hold any of a sequence's pages (a page may straddle two tiles), sorted, without repeats
    sentinel = (rows + kv_tile - 1) // kv_tile
    first = torch.where(used, tables * per_block // kv_tile, sentinel)
    last = torch.where(used, (tables * per_block + block_size - 1) // kv_tile, sentinel)
    tiles = torch.cat([first, last], dim=1).sort(dim=1).values
    repeat = torch.zeros_like(tiles, dtype=torch.bool)
    repeat[:, 1:] = tiles[:, 1:] == tiles[:, :-1]
    tiles = torch.where(repeat, sentinel, tiles).sort(dim=1).values
    counts = (tiles < sentinel).sum(dim=1)
    width_tiles = max(1, int(counts.max()))
    q_tiles = -(-q_len // TILE)
    kv_num = counts.to(torch.int32)[:, None, None].expand(batch, 1, q_tiles).contiguous()
    kv_idx = torch.where(tiles[:, :width_tiles] < sentinel, tiles[:, :width_tiles], 0).to(torch.int32)
    kv_idx = kv_idx[:, None, None, :].expand(batch, 1, q_tiles, width_tiles).contiguous()
    try:
        return BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(TILE, kv_tile), mask_mod=mask_mod,
                                        seq_lengths=(q_len, rows), compute_q_blocks=False)
    except TypeError:  # an older signature
        return BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(TILE, kv_tile), mask_mod=mask_mod,
                                        seq_lengths=(q_len, rows))


def flex_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float | None = None,
                         block_mask: BlockMask | None = None, kv_tile: int = TILE) -> torch.Tensor:
    """Attention of ``q`` over each sequence's context in the pool, by FlexAttention on the pool's own memory.

    ``q``: [B, Hq, D] (decode: one token per sequence, the last of its ``seq_lens[b]``) or [B, Sq, Hq, D] (the last
    ``Sq`` tokens, causal); ``k_cache``/``v_cache``: one layer's views [num_blocks, block_size, Hkv, D] of the pool
    (``torch_views.layer_kv``). ``block_mask``: from ``paged_block_mask`` (made here when None; pass one to reuse
    it over layers). Returns q's shape."""
    decode = q.dim() == 3
    q4 = (q[:, None] if decode else q).transpose(1, 2)  # [B, Hq, Sq, D]
    k, per_block = token_rows(k_cache)
    v, per_block_v = token_rows(v_cache)
    if per_block_v != per_block or v.shape != k.shape:
        raise ValueError("K and V views must have the same shape and strides")
    if block_mask is None:
        block_mask = paged_block_mask(block_tables, seq_lens, q4.shape[2], num_blocks=k_cache.shape[0],
                                      block_size=k_cache.shape[1], per_block=per_block, rows=k.shape[2],
                                      kv_tile=kv_tile)
    gqa = q4.shape[1] != k.shape[1]
    if q4.is_cuda:
        global _compiled
        if _compiled is None:
            _compiled = torch.compile(flex_attention, dynamic=False)
        out = _compiled(q4, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    else:
        out = flex_attention(q4, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    out = out.transpose(1, 2)  # [B, Sq, Hq, D]
    return out[:, 0] if decode else out
