"""kvpool's KV ops as PyTorch custom ops (``torch.ops.kvpool.*``): they trace under ``torch.compile`` and run inside
CUDA graphs, because they take only device tensors and never synchronize with the host.

    write_layer(blocks, layer, slots, k, v, error)        k, v [n, H, D]  ->  layer ``layer`` at ``slots`` [n]
    read_layer(blocks, layer, slots, error) -> (k, v)     the gather of a prefill's context: [n, H, D] each
    write_tokens(blocks, slots, data, error)              data [n, L, 2, H, D]  ->  every layer at ``slots``
    read_tokens(blocks, slots, error) -> data             [n, L, 2, H, D]
    paged_decode(q, blocks, layer, block_tables, seq_lens, scale) -> out      q, out [B, Hq, D]

``blocks`` is the pool as one tensor, ``[num_blocks, L, 2, block_size, H, D]`` (``torch_views.blocks(pool)``, either
layout: the kernels read its strides) -- or an in-process cache of the same shape. ``slots``: int32/int64 device
tensors; ``error``: an int32 [1] device tensor the caller owns.

Checks are split: shapes, dtypes and devices are the caller's contract (an engine checks them once, when it builds
its buffers); slot ranges are checked on the host when a step is planned (the slots come from an Append reply,
which is on the host anyway). What still reaches a kernel out of the pool -- a slot outside ``[0, num_slots)`` --
is skipped by a write (nothing is written outside the pool), read as zeros by a read, and sets ``error[0] = 1``;
the caller reads ``error`` when it synchronizes anyway (an engine: once a request batch). No op reads a tensor back to the host.

On CUDA the moves are the client's slot kernel (``slot_kernels``, CuPy, enqueued on PyTorch's current stream, so a
CUDA graph captures it) and the decode is the Triton kernel of ``paged_attention``; on the CPU both are plain
PyTorch below, the reference the tests compare against. ``register_fake`` gives each op its output shapes for
tracing (FakeTensor / meta), so ``torch.compile(fullgraph=True)`` sees them as single nodes.
"""

from __future__ import annotations

import torch

from kvpool_client.kernels.paged_attention import paged_decode_attention

Tensor = torch.Tensor


def _num_slots(blocks: Tensor) -> int:
    return blocks.shape[0] * blocks.shape[3]


def _launch_rows(blocks: Tensor, slots: Tensor, dense_k: int, dense_v: int, stride_k: int, stride_v: int,
                 rows_per_token: int, first_seg: int, error: Tensor, to_pool: bool) -> None:
    """One slot-kernel launch on the current PyTorch stream (addresses and strides in bytes)."""
    import cupy  # noqa: PLC0415  (CUDA only)

    from kvpool_client.kernels import slot_kernels  # noqa: PLC0415
    from kvpool_client.kernels.device_path import _wrap  # noqa: PLC0415

    item = blocks.element_size()
    with cupy.cuda.Device(blocks.device.index):
        slot_kernels.launch(pool_ptr=blocks.data_ptr(), dense_k=dense_k, dense_v=dense_v, stride_k=stride_k,
                            stride_v=stride_v, slots_ptr=slots.data_ptr(),
                            slot_dtype="int64" if slots.dtype == torch.int64 else "int32",
                            num_tokens=slots.shape[0], rows_per_token=rows_per_token,
                            row_bytes=blocks.shape[4] * blocks.shape[5] * item, num_slots=_num_slots(blocks),
                            block_size=blocks.shape[3], block_stride=blocks.stride(0) * item,
                            seg_stride=blocks.stride(2) * item, first_seg=first_seg, error_ptr=error.data_ptr(),
                            to_pool=to_pool, stream=_wrap(torch.cuda.current_stream(blocks.device).cuda_stream))


def _split(blocks: Tensor, slots: Tensor, error: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """CPU: (block ids, offsets, kept) of the slots inside the pool; flags the rest in ``error``."""
    s = slots.long()
    inside = (s >= 0) & (s < _num_slots(blocks))
    error.bitwise_or_((~inside).any().to(error.dtype))
    s = s[inside]
    return s // blocks.shape[3], s % blocks.shape[3], inside


def _layer_args(k: Tensor, v: Tensor) -> tuple[int, int, int, int]:
    return k.data_ptr(), v.data_ptr(), k.stride(0) * k.element_size(), v.stride(0) * v.element_size()


@torch.library.custom_op("kvpool::write_layer", mutates_args=("blocks", "error"))
def write_layer(blocks: Tensor, layer: int, slots: Tensor, k: Tensor, v: Tensor, error: Tensor) -> None:
    """Layer ``layer``'s K and V of n new tokens into ``slots`` (vLLM's ``reshape_and_cache``). ``k``/``v``: any
    stride on the first dimension (views of a fused QKV output), the last two contiguous."""
    if blocks.is_cuda:
        _launch_rows(blocks, slots, *_layer_args(k, v), 2, 2 * layer, error, True)
        return
    b, o, inside = _split(blocks, slots, error)
    blocks[b, layer, 0, o] = k[inside].to(blocks.dtype)
    blocks[b, layer, 1, o] = v[inside].to(blocks.dtype)


@torch.library.custom_op("kvpool::read_layer", mutates_args=("error",))
def read_layer(blocks: Tensor, layer: int, slots: Tensor, error: Tensor) -> tuple[Tensor, Tensor]:
    """Copies of layer ``layer``'s K and V at ``slots``, each [n, H, D] (out-of-pool slots: left zero)."""
    shape = (slots.shape[0], blocks.shape[4], blocks.shape[5])
    if blocks.is_cuda:  # the kernel writes every row (zeros for an out-of-pool slot): no fill first
        k, v = blocks.new_empty(shape), blocks.new_empty(shape)
        _launch_rows(blocks, slots, *_layer_args(k, v), 2, 2 * layer, error, False)
        return k, v
    k = torch.zeros(shape, dtype=blocks.dtype, device=blocks.device)
    v = torch.zeros_like(k)
    b, o, inside = _split(blocks, slots, error)
    k[inside], v[inside] = blocks[b, layer, 0, o], blocks[b, layer, 1, o]
    return k, v


@read_layer.register_fake
def _(blocks: Tensor, layer: int, slots: Tensor, error: Tensor) -> tuple[Tensor, Tensor]:
    shape = (slots.shape[0], blocks.shape[4], blocks.shape[5])
    return blocks.new_empty(shape), blocks.new_empty(shape)


@torch.library.custom_op("kvpool::write_tokens", mutates_args=("blocks", "error"))
def write_tokens(blocks: Tensor, slots: Tensor, data: Tensor, error: Tensor) -> None:
    """Whole tokens' KV ``data`` [n, L, 2, H, D] (contiguous) into ``slots``."""
    if blocks.is_cuda:
        tb = data.stride(0) * data.element_size()
        row = blocks.shape[4] * blocks.shape[5] * blocks.element_size()
        _launch_rows(blocks, slots, data.data_ptr(), data.data_ptr() + row, tb, tb, 2 * blocks.shape[1], 0, error,
                     True)
        return
    b, o, inside = _split(blocks, slots, error)
    blocks[b, :, :, o] = data[inside].to(blocks.dtype)


@torch.library.custom_op("kvpool::read_tokens", mutates_args=("error",))
def read_tokens(blocks: Tensor, slots: Tensor, error: Tensor) -> Tensor:
    """Copies of the whole tokens at ``slots``, [n, L, 2, H, D] (out-of-pool slots: left zero)."""
    shape = (slots.shape[0], *blocks.shape[1:3], *blocks.shape[4:])
    # on CUDA the kernel writes every row (zeros for an out-of-pool slot): no fill first
    out = blocks.new_empty(shape) if blocks.is_cuda else torch.zeros(shape, dtype=blocks.dtype, device=blocks.device)
    if blocks.is_cuda:
        tb = out.stride(0) * out.element_size()
        row = blocks.shape[4] * blocks.shape[5] * blocks.element_size()
        _launch_rows(blocks, slots, out.data_ptr(), out.data_ptr() + row, tb, tb, 2 * blocks.shape[1], 0, error,
                     False)
        return out
    b, o, inside = _split(blocks, slots, error)
    out[inside] = blocks[b, :, :, o]
    return out


@read_tokens.register_fake
def _(blocks: Tensor, slots: Tensor, error: Tensor) -> Tensor:
    return blocks.new_empty((slots.shape[0], *blocks.shape[1:3], *blocks.shape[4:]))


@torch.library.custom_op("kvpool::paged_decode", mutates_args=())
def paged_decode(q: Tensor, blocks: Tensor, layer: int, block_tables: Tensor, seq_lens: Tensor,
                 scale: float) -> Tensor:
    """Decode attention of one query token per sequence (q [B, Hq, D]) over layer ``layer`` of the pool through
    ``block_tables`` int32 [B, max_blocks] and ``seq_lens`` int32 [B] (each >= 1; the tables' entries up to the
    length must be the sequences' blocks: the engine's tables come from Append replies)."""
    return paged_decode_attention(q, blocks[:, layer, 0], blocks[:, layer, 1], block_tables, seq_lens, scale)


@paged_decode.register_fake
def _(q: Tensor, blocks: Tensor, layer: int, block_tables: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q)


def new_error_flag(device: torch.device | str) -> Tensor:
    """The int32 [1] flag the ops raise on an out-of-pool slot."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@write_layer.register_fake
def _(blocks: Tensor, layer: int, slots: Tensor, k: Tensor, v: Tensor, error: Tensor) -> None:
    return None


@write_tokens.register_fake
def _(blocks: Tensor, slots: Tensor, data: Tensor, error: Tensor) -> None:
    return None
