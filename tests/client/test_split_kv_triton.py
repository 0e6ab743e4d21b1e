"""``kernels/split_kv_triton.py``: the one-launch split-KV kernel, its pieces merged, against the math path -- on the
CPU under Triton's interpreter (``split_kv_triton_cases.py`` in a subprocess: the interpreter is chosen before
Triton is imported), on CUDA the compiled kernel (fp16 and bf16, a graph bucket's padded K/V, the engine's plan)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvpool_client.kernels import split_kv, split_kv_triton  # noqa: E402
from kvpool_client.kernels.prefill_attention import PrefillSpans, _math_attention  # noqa: E402

CASES = Path(__file__).with_name("split_kv_triton_cases.py")


@pytest.mark.skipif(split_kv_triton.triton is None, reason="Triton is not installed here")
def test_cpu_the_interpreted_kernel_matches_the_math_path():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(CASES)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def test_cpu_tensors_are_not_taken():
    q, k = torch.zeros(4, 8, 128, dtype=torch.float16), torch.zeros(4, 2, 128, dtype=torch.float16)
    assert not split_kv_triton.supported(q, k)


cuda = pytest.mark.skipif(not torch.cuda.is_available() or split_kv_triton.triton is None,
                          reason="the compiled kernel needs CUDA and Triton")


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,m,pieces", [(256, 4352, 4), (64, 8192, 8), (16, 2048, 2), (100, 5000, 3), (37, 37, 2)])
def test_on_cuda_the_kernel_matches_the_math_path(dtype, n, m, pieces):
    gen = torch.Generator().manual_seed(n + m)
    q = torch.randn(n, 48, 128, generator=gen).to(dtype).cuda()[:, :32]  # a view of a QKV product's rows
    k, v = (torch.randn(m + 300, 8, 128, generator=gen).to(dtype).cuda() for _ in range(2))
    k[m:], v[m:] = 1e4, float("nan")  # a graph bucket's rows past the span: never read
    cu_own = torch.tensor([m - n, m], dtype=torch.int32, device="cuda")
    out, lse = split_kv_triton.pieces_attention(q, k, v, cu_own, pieces, 128 ** -0.5)
    got = split_kv.merge(out[:pieces].reshape(pieces * n, 32, 128), out[pieces], lse).float()
    spans = PrefillSpans.of([(0, n, torch.arange(m, device="cuda"))])
    want = _math_attention(q.float(), k[:m].float(), v[:m].float(), spans, 4, 128 ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    assert torch.isinf(lse[:, :pieces]).all() == (m == n)


@cuda
def test_on_cuda_the_engine_plan_takes_the_kernel_and_agrees_with_the_flash_split(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    n, m = 256, 4352
    q = torch.randn(n, 32, 128, generator=gen).half().cuda()
    k, v = (torch.randn(m, 8, 128, generator=gen).half().cuda() for _ in range(2))
    spans = PrefillSpans.of([(0, n, torch.arange(m, device="cuda"))])
    plan = split_kv.split_plan(spans, 32, q.device)
    assert plan is not None and plan.kernel == "triton"
    got = split_kv.split_attention(q, k, v, plan, 128 ** -0.5).float()
    monkeypatch.setenv(split_kv.ENV, "flash")
    flash_plan = split_kv.split_plan(spans, 32, q.device)
    assert flash_plan is not None and flash_plan.kernel == "flash"
    flash = split_kv.split_attention(q, k, v, flash_plan, 128 ** -0.5).float()
    torch.testing.assert_close(got, flash, atol=2e-3, rtol=0)
