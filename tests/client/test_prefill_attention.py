"""The prefill's attention over the pool (``kernels/prefill_attention.py``): several sequences' new tokens over
contexts scattered through a pool tensor, against a float64 reference written here (GQA, causal offset to the new
tokens' positions); on CUDA the varlen flash kernel against the math path."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpool_client.kernels import torch_ops  # noqa: E402
from kvpool_client.kernels.prefill_attention import PrefillSpans, prefill_attention, uses_flash  # noqa: E402

LAYERS, HKV, GROUP, D, BLOCK, NUM_BLOCKS = 2, 2, 3, 16, 4, 40


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, n: int, scale: float) -> np.ndarray:
    """q [n, Hq, D] over k, v [m, Hkv, D]: query i sees keys 0 .. m - n + i; query head h reads KV head h // GROUP."""
    m = k.shape[0]
    kk, vv = np.repeat(k, GROUP, axis=1), np.repeat(v, GROUP, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, kk) * scale
    scores[:, ~(np.arange(m)[None, :] <= (m - n + np.arange(n))[:, None])] = -np.inf
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p, vv)


def scenario(device: str, dtype: torch.dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    blocks = torch.from_numpy(rng.standard_normal((NUM_BLOCKS, LAYERS, 2, BLOCK, HKV, D))).to(device, dtype)
    free = rng.permutation(NUM_BLOCKS * BLOCK)
    spans, start, used = [], 0, 0
    for n, m in [(1, 1), (5, 23), (3, 3), (7, 40)]:  # a one-token prompt, a cached run + suffix, a whole prompt
        ctx = torch.from_numpy(free[used:used + m].copy()).to(device)
        spans.append((start, n, ctx))
        start, used = start + n, used + m
    q = torch.from_numpy(rng.standard_normal((start, HKV * GROUP, D))).to(device, dtype)
    return blocks, spans, q


@pytest.mark.parametrize("layer", [0, 1])
def test_every_span_attends_to_its_own_context_causally(layer):
    blocks, spans, q = scenario("cpu", torch.float32)
    error = torch_ops.new_error_flag("cpu")
    out = prefill_attention(q, blocks, layer, PrefillSpans.of(spans), error, GROUP, scale=0.25)
    assert int(error.item()) == 0
    b64 = blocks.double().numpy()
    for start, n, ctx in spans:
        c = ctx.numpy()
        k, v = b64[c // BLOCK, layer, 0, c % BLOCK], b64[c // BLOCK, layer, 1, c % BLOCK]
        want = reference(q[start:start + n].double().numpy(), k, v, n, 0.25)
        np.testing.assert_allclose(out[start:start + n].numpy(), want, atol=1e-5)


def test_spans_that_do_not_tile_q_are_refused():
    ctx = torch.arange(8)
    with pytest.raises(ValueError, match="consecutive"):
        PrefillSpans.of([(0, 2, ctx), (3, 1, ctx)])  # a gap after the first span's rows
    with pytest.raises(ValueError, match="consecutive"):
        PrefillSpans.of([(0, 9, ctx)])  # more new tokens than the context holds
    with pytest.raises(ValueError, match="at least one"):
        PrefillSpans.of([])
    packed = PrefillSpans.of([(0, 2, ctx), (2, 8, ctx)])
    assert packed.starts_k == [0, 8, 16] and packed.cu_q.tolist() == [0, 2, 10]
    assert (packed.max_q, packed.max_k) == (8, 8) and packed.context.shape[0] == 16


def test_the_cpu_takes_the_math_path():
    assert not uses_flash(torch.zeros(1, 4, D))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen flash kernel needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_on_cuda_matches_the_math_path(dtype):
    blocks, spans, q = scenario("cuda", dtype)
    error = torch_ops.new_error_flag("cuda")
    packed = PrefillSpans.of(spans)
    assert uses_flash(q)
    flash = prefill_attention(q, blocks, 1, packed, error, GROUP, scale=0.25).float()
    from kvpool_client.kernels.prefill_attention import _math_attention
    k, v = torch.ops.kvpool.read_layer(blocks, 1, packed.context, error)
    math = _math_attention(q.float(), k.float(), v.float(), packed, GROUP, 0.25)
    assert int(error.item()) == 0
    torch.testing.assert_close(flash, math, atol=2e-2, rtol=0)
