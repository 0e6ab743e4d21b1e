"""Split-KV prefill attention (``kernels/split_kv.py``): the pieces and their log-sum-exp merge against the one
causal attention, on the CPU with a reference of the varlen flash call (its lengths from ``cu_q``/``cu_k``, keys
from the offset ``cu_k`` starts at, GQA, bottom-right causal, ``lse = +inf`` for a query without keys); on CUDA
the real kernel against the one flash call and the math path."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kvpool_client.kernels import split_kv  # noqa: E402
from kvpool_client.kernels.prefill_attention import PrefillSpans, _math_attention  # noqa: E402

HQ, HKV, D = 4, 2, 8


def reference_flash(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """What ``aten::_flash_attention_forward`` computes for varlen inputs, in float32: (out, lse [Hq, total_q])."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        assert q1 - q0 <= max_q and k1 - k0 <= max_k
        qb = q[q0:q1].float()
        if k1 == k0:  # no keys: the kernel writes 0 and lse +inf
            outs.append(torch.zeros_like(qb))
            lses.append(torch.full((q.shape[1], q1 - q0), math.inf))
            continue
        kb = k[k0:k1].float().repeat_interleave(group, 1)
        vb = v[k0:k1].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        if causal:
            nq, nk = q1 - q0, k1 - k0
            allowed = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
            scores = scores.masked_fill(~allowed, -math.inf)
        lses.append(torch.logsumexp(scores, -1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vb))
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)


@pytest.mark.parametrize("n,m,pieces", [(16, 600, 2), (16, 600, 5), (7, 40, 3), (9, 11, 4), (5, 5, 3), (32, 32 + 64, 16)],
                         ids=["2", "5", "odd", "fewer-keys-than-pieces", "no-prefix", "16"])
def test_pieces_merged_equal_the_one_causal_attention(monkeypatch, n, m, pieces):
    monkeypatch.setattr(split_kv, "_flash", reference_flash)
    gen = torch.Generator().manual_seed(n * 1000 + m)
    q = torch.randn(n, HQ, D, generator=gen)
    k, v = torch.randn(m, HKV, D, generator=gen), torch.randn(m, HKV, D, generator=gen)
    spans = PrefillSpans.of([(0, n, torch.arange(m))])
    plan = split_kv.make_plan(spans.cu_k, n, m, pieces)
    got = split_kv.split_attention(q, k, v, plan, scale=0.3)
    want = _math_attention(q, k, v, spans, HQ // HKV, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    one_call = reference_flash(q, k, v, spans.cu_q, spans.cu_k, n, m, True, 0.3)[0]
    torch.testing.assert_close(one_call, want, atol=1e-5, rtol=1e-5)  # the reference is the kernel's semantics


def test_a_padded_bucket_splits_only_the_real_keys(monkeypatch):
    """A graph bucket: static sizes larger than the prompt (max_k the bucket's), the real lengths in ``cu_k``."""
    monkeypatch.setattr(split_kv, "_flash", reference_flash)
    gen = torch.Generator().manual_seed(5)
    n, m, bucket = 16, 300, 1024
    q = torch.randn(n, HQ, D, generator=gen)
    k, v = torch.randn(bucket, HKV, D, generator=gen), torch.randn(bucket, HKV, D, generator=gen)
    cu_k = torch.tensor([0, m], dtype=torch.int32)
    plan = split_kv.make_plan(cu_k, n, bucket, 4)
    assert plan.max_piece >= math.ceil((m - n) / 4)
    got = split_kv.split_attention(q, k, v, plan, scale=0.3)
    want = _math_attention(q, k[:m], v[:m], PrefillSpans.of([(0, n, torch.arange(m))]), HQ // HKV, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_how_many_pieces():
    assert split_kv.pieces_for(256, 4352, 32, 132) == 4  # 64 programs: 4 pieces make 256, within two waves
    assert split_kv.pieces_for(64, 8192, 32, 132) == 8  # 32 programs
    assert split_kv.pieces_for(128, 4352, 16, 132) == 8  # a tensor-parallel rank's 16 heads: keys bound it
    assert split_kv.pieces_for(1024, 4352, 32, 132) == 1  # 256 programs: a long suffix fills the device alone
    assert split_kv.pieces_for(64, 700, 32, 132) == 1  # too few keys for two pieces of MIN_PIECE_KEYS
    assert split_kv.pieces_for(16, 1 << 20, 8, 132) == split_kv.MAX_PIECES


def test_the_cpu_and_several_spans_are_not_split():
    spans = PrefillSpans.of([(0, 16, torch.arange(5000))])
    assert split_kv.split_plan(spans, 32, torch.device("cpu")) is None
    two = PrefillSpans.of([(0, 16, torch.arange(5000)), (16, 16, torch.arange(5000))])
    assert split_kv.split_plan(two, 32, torch.device("cuda")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen flash kernel needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,m", [(256, 4352), (64, 8192), (16, 2048), (100, 5000)])
def test_on_cuda_the_split_matches_one_flash_call_and_the_math_path(dtype, n, m):
    gen = torch.Generator().manual_seed(n + m)
    q = torch.randn(n, 32, 128, generator=gen).to(dtype).cuda()
    k, v = (torch.randn(m, 8, 128, generator=gen).to(dtype).cuda() for _ in range(2))
    spans = PrefillSpans.of([(0, n, torch.arange(m, device="cuda"))])
    plan = split_kv.split_plan(spans, 32, q.device)
    assert plan is not None and plan.pieces >= 2
    got = split_kv.split_attention(q, k, v, plan, scale=128 ** -0.5).float()
    one = split_kv._flash(q, k, v, spans.cu_q, spans.cu_k, n, m, True, 128 ** -0.5)[0].float()
    math_path = _math_attention(q.float(), k.float(), v.float(), spans, 4, 128 ** -0.5)
    torch.testing.assert_close(got, math_path, atol=2e-2, rtol=0)
    torch.testing.assert_close(got, one, atol=2e-2, rtol=0)


@pytest.mark.skipif(split_kv._merge_kernel is None, reason="Triton is not installed here")
@pytest.mark.parametrize("pieces,empty", [(2, 0), (5, 2), (16, 15)])
def test_the_merge_kernel_matches_the_torch_merge(monkeypatch, pieces, empty):
    """The Triton merge under its interpreter (CPU tensors) against PyTorch's arithmetic, ``empty`` pieces without
    keys (lse +inf): fp16 outputs, float32 sums."""
    from triton.runtime.interpreter import InterpretedFunction

    gen = torch.Generator().manual_seed(pieces)
    n, heads, dim = 7, 3, 16
    o_pieces = torch.randn(pieces * n, heads, dim, generator=gen).half()
    o_own = torch.randn(n, heads, dim, generator=gen).half()
    lse = torch.randn(heads, pieces + 1, n, generator=gen) * 3
    lse[:, :empty] = math.inf
    want = split_kv.merge(o_pieces, o_own, lse)
    monkeypatch.setattr(split_kv, "_merge_kernel", InterpretedFunction(split_kv._merge_kernel.fn))
    monkeypatch.setattr(split_kv, "MERGE_ON_CPU", True)
    got = split_kv.merge(o_pieces, o_own, lse)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=1e-3)
