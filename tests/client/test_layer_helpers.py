"""The layers' elementwise helper sets (``integrations/layer_helpers.py``): eager against transformers' own Llama
modules on the CPU; on CUDA, Liger-Kernel's kernels against eager (fp16 and bf16: within one rounding step of the
dtype), on the strided views the engine hands them, and a row normalised identically whatever the rows around it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool_client.integrations import layer_helpers  # noqa: E402
from kvpool_client.integrations.layer_helpers import EAGER, helpers  # noqa: E402

HQ, HKV, D, HIDDEN, INTER = 8, 2, 64, 256, 512


def _llama_config() -> object:
    return transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HQ,
                                    num_key_value_heads=HKV, head_dim=D, rms_norm_eps=1e-5)


def test_eager_is_transformers_op_for_op():
    from transformers.models.llama import modeling_llama as ml
    torch.manual_seed(0)
    config = _llama_config()
    norm = ml.LlamaRMSNorm(HIDDEN, eps=config.rms_norm_eps)
    norm.weight.data.uniform_(0.5, 1.5)
    x, r = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    assert torch.equal(EAGER["rms_norm"](x, norm.weight, 1e-5), norm(x))
    h, normed = EAGER["add_rms_norm"](x, r, norm.weight, 1e-5)
    assert torch.equal(h, x + r) and torch.equal(normed, norm(x + r))
    rotary = ml.LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 3, 7, 100, 2000]])
    cos, sin = rotary(x, positions)
    q, k = torch.randn(1, HQ, 5, D), torch.randn(1, HKV, 5, D)
    ref_q, ref_k = ml.apply_rotary_pos_emb(q, k, cos, sin)
    ours_q, ours_k = EAGER["rope"](q[0].transpose(0, 1), k[0].transpose(0, 1), cos[0, :, None], sin[0, :, None])
    assert torch.equal(ours_q, ref_q[0].transpose(0, 1)) and torch.equal(ours_k, ref_k[0].transpose(0, 1))
    mlp = ml.LlamaMLP(config)
    gate_up = torch.cat((mlp.gate_proj(x), mlp.up_proj(x)), -1)
    assert torch.equal(mlp.down_proj(EAGER["silu_mul"](gate_up)), mlp(x))


def test_an_unknown_set_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown elementwise helpers 'fast'"):
        helpers("fast")
    monkeypatch.setenv("KVPOOL_ENGINE_HELPERS", "eager")
    assert layer_helpers.default_helpers("cuda") == "eager"
    monkeypatch.delenv("KVPOOL_ENGINE_HELPERS")
    assert layer_helpers.default_helpers("cpu") == "eager"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Liger's kernels are Triton)")
liger = pytest.mark.skipif(not layer_helpers.liger_available(), reason="liger-kernel is not installed")


def _close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Within one rounding step of ``dtype`` at the values' magnitude (Triton's exp / reduction order vs PyTorch's)."""
    step = torch.finfo(dtype).eps * ref.float().abs().clamp_min(1.0)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    assert bool(((ours.float() - ref.float()).abs() <= step).all()), (ours.float() - ref.float()).abs().max()


@cuda
@liger
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_liger_matches_eager_on_the_engines_views(dtype):
    torch.manual_seed(1)
    f, dev, t = helpers("liger"), "cuda", 37
    weight = torch.rand(HIDDEN, device=dev, dtype=dtype) + 0.5
    x, r = torch.randn(t, HIDDEN, device=dev, dtype=dtype), torch.randn(t, HIDDEN, device=dev, dtype=dtype)
    _close(f["rms_norm"](x, weight, 1e-5), EAGER["rms_norm"](x, weight, 1e-5), dtype)
    h, normed = f["add_rms_norm"](x, r, weight, 1e-5)
    ref_h, ref_normed = EAGER["add_rms_norm"](x, r, weight, 1e-5)
    assert torch.equal(h, ref_h)
    _close(normed, ref_normed, dtype)
    # q, k as the fused QKV GEMM's strided views; cos, sin as Llama's rotary gives them
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=dev, dtype=dtype)
    q, k, _ = qkv.split([HQ * D, HKV * D, HKV * D], -1)
    q, k = q.view(t, HQ, D), k.view(t, HKV, D)
    original = qkv.clone()
    freqs = torch.rand(t, D // 2, device=dev) * 50
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    ref_q, ref_k = EAGER["rope"](q, k, cos, sin)
    ours_q, ours_k = f["rope"](q, k, cos, sin)  # in place, on the views
    assert ours_q.data_ptr() == q.data_ptr() and ours_k.data_ptr() == k.data_ptr()
    assert torch.equal(qkv[:, (HQ + HKV) * D:], original[:, (HQ + HKV) * D:]), "RoPE wrote into V"
    _close(ours_q, ref_q, dtype)
    _close(ours_k, ref_k, dtype)
    q0, k0, _ = original.split([HQ * D, HKV * D, HKV * D], -1)  # contiguous inputs: the same result
    dense_q, dense_k = f["rope"](q0.reshape(t, HQ, D).clone(), k0.reshape(t, HKV, D).clone(), cos, sin)
    assert torch.equal(dense_q, ours_q) and torch.equal(dense_k, ours_k)
    gate_up = torch.randn(t, 2 * INTER, device=dev, dtype=dtype) * 4
    _close(f["silu_mul"](gate_up), EAGER["silu_mul"](gate_up), dtype)


@cuda
@liger
def test_liger_normalises_a_row_the_same_whatever_the_rows_around_it():
    torch.manual_seed(2)
    f, dev = helpers("liger"), "cuda"
    weight = torch.rand(4096, device=dev, dtype=torch.float16) + 0.5
    big = torch.randn(4352, 4096, device=dev, dtype=torch.float16)
    r = torch.randn_like(big)
    small_h, small = f["add_rms_norm"](big[-256:].clone(), r[-256:].clone(), weight, 1e-5)
    full_h, full = f["add_rms_norm"](big, r, weight, 1e-5)
    assert torch.equal(small, full[-256:]) and torch.equal(small_h, full_h[-256:])
