"""``torch.ops.kvpool`` against the NumPy references (``kernels.reference``), on both pool layouts; out-of-pool slots
raise the error flag and write nothing; the ops trace under ``torch.compile(fullgraph=True)`` and, on CUDA, replay
inside a CUDA graph. The CPU case runs wherever PyTorch is installed; CUDA cases where there is a GPU and CuPy."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpool.layout import KVLayout, blocks_view  # noqa: E402
from kvpool_client.kernels import reference  # noqa: E402
from kvpool_client.kernels import torch_ops as ops  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LAYOUTS = ["block-major", "layer-major"]
NUM_BLOCKS = 12


def make_blocks(device: str, kv_layout: str, dtype: str = "float32") -> torch.Tensor:
    """A pool-shaped tensor in ``kv_layout`` (layer-major: a transposed view, as the attached pool's is)."""
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype, kv_layout=kv_layout)
    flat = torch.randn(NUM_BLOCKS * layout.block_bytes // layout.itemsize, generator=torch.Generator().manual_seed(0))
    flat = flat.to(getattr(torch, dtype)).to(device)
    raw = flat.reshape(layout.storage_shape(NUM_BLOCKS))
    view = raw.permute(2, 0, 1, 3, 4, 5) if layout.layer_major else raw
    assert tuple(view.shape) == tuple(blocks_view(np.zeros(flat.numel()), layout, NUM_BLOCKS).shape)
    return view


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_moves_match_the_reference(device, kv_layout):
    blocks = make_blocks(device, kv_layout)
    expected = blocks.cpu().numpy().copy()
    error = ops.new_error_flag(device)
    slots = torch.tensor([3, 17, 40, 9], device=device)
    k, v = torch.randn(4, 2, 16, device=device), torch.randn(4, 2, 16, device=device)
    torch.ops.kvpool.write_layer(blocks, 1, slots, k, v, error)
    reference.write_layer(expected, 1, slots.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy())
    assert np.array_equal(blocks.cpu().numpy(), expected)
    data = torch.randn(2, 3, 2, 2, 16, device=device)
    torch.ops.kvpool.write_tokens(blocks, slots[:2].int(), data, error)
    reference.write_tokens(expected, slots[:2].cpu().numpy(), data.cpu().numpy())
    assert np.array_equal(blocks.cpu().numpy(), expected)
    rk, rv = torch.ops.kvpool.read_layer(blocks, 2, slots, error)
    ek, ev = reference.read_layer(expected, 2, slots.cpu().numpy())
    assert np.array_equal(rk.cpu().numpy(), ek) and np.array_equal(rv.cpu().numpy(), ev)
    tokens = torch.ops.kvpool.read_tokens(blocks, slots, error)
    assert np.array_equal(tokens.cpu().numpy(), reference.read_tokens(expected, slots.cpu().numpy()))
    assert int(error.item()) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_pool_slots_raise_the_flag_and_write_nothing(device):
    blocks = make_blocks(device, "block-major")
    before = blocks.clone()
    error = ops.new_error_flag(device)
    k = torch.randn(2, 2, 16, device=device)
    torch.ops.kvpool.write_layer(blocks, 0, torch.tensor([-1, NUM_BLOCKS * 4], device=device), k, k, error)
    assert torch.equal(blocks, before) and int(error.item()) == 1
    error.zero_()
    rk, _ = torch.ops.kvpool.read_layer(blocks, 0, torch.tensor([5, NUM_BLOCKS * 4], device=device), error)
    assert int(error.item()) == 1 and torch.equal(rk[0], blocks[1, 0, 0, 1]) and not rk[1].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_paged_decode_matches_the_reference(device, kv_layout):
    dtype = "float16" if device == "cuda" else "float32"
    blocks = make_blocks(device, kv_layout, dtype)
    q = torch.randn(3, 4, 16, device=device).to(blocks.dtype)
    tables = torch.tensor([[2, 7, 1], [11, 0, 0], [5, 3, 9]], dtype=torch.int32, device=device)
    lens = torch.tensor([9, 1, 12], dtype=torch.int32, device=device)
    out = torch.ops.kvpool.paged_decode(q, blocks, 1, tables, lens, 0.25)
    k_cache, v_cache = (blocks[:, 1, i].cpu().float().numpy() for i in (0, 1))
    expected = reference.paged_decode_attention(q.cpu().float().numpy(), k_cache, v_cache, tables.cpu().numpy(),
                                                lens.cpu().numpy(), 0.25)
    assert np.allclose(out.cpu().float().numpy(), expected, atol=2e-3 if device == "cuda" else 1e-5)


def _step(blocks, slots, k, v, error, q, tables, lens):
    torch.ops.kvpool.write_layer(blocks, 0, slots, k, v, error)
    return torch.ops.kvpool.paged_decode(q, blocks, 0, tables, lens, 0.25) * 2


def _inputs(device: str):
    blocks = make_blocks(device, "block-major", "float16" if device == "cuda" else "float32")
    k = torch.randn(2, 2, 16, device=device).to(blocks.dtype)
    q = torch.randn(2, 4, 16, device=device).to(blocks.dtype)
    return (blocks, torch.tensor([8, 13], device=device), k, k.clone(), ops.new_error_flag(device), q,
            torch.tensor([[2, 0], [3, 0]], dtype=torch.int32, device=device),
            torch.tensor([1, 2], dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_ops_trace_under_torch_compile(device):
    """fullgraph=True: the ops are single nodes (their fake implementations give the shapes), no graph break."""
    args = _inputs(device)
    expected = _step(*(a.clone() for a in args))
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    assert torch.allclose(out, expected) and int(args[4].item()) == 0
    assert torch.equal(args[0][2, 0, 0, 0], args[2][0])  # the write happened on the real pool tensor


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh engine)")
def test_ops_replay_inside_a_cuda_graph():
    args = _inputs("cuda")
    blocks, slots, k = args[0], args[1], args[2]
    _step(*args)  # warm-up: compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(*args)
    k.copy_(torch.full_like(k, 0.5))
    slots.copy_(torch.tensor([9, 14], device="cuda"))  # new inputs in the same buffers
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(blocks[2, 0, 0, 1], k[0]) and torch.equal(blocks[3, 0, 0, 2], k[1])
    assert torch.allclose(out, _step(*args)) and int(args[4].item()) == 0
