"""What the engine tests share (test_engine.py, test_engine_tp.py): the devices they run on, the documented logit
bound, a tiny random Llama, random prompts, a beam search that records each step's logits."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool_client.integrations.hf_llama import beam_search  # noqa: E402

CASES = [pytest.param("cpu", "float32", id="cpu-float32")]
if torch.cuda.is_available():
    CASES += [pytest.param("cuda", "float16", id="cuda-float16")]
# The documented bound: max |logit diff| / max |logit| over every step, teacher-forced (the dense model decodes the
# same beams). float32: summation order only; float16: the Triton decode's float32 online softmax against SDPA, and
# the engine's fused Q/K/V and gate/up GEMMs and compiled elementwise helpers against transformers' separate ones
# (measured on the H200: 5.0e-3 greedy, 9.3e-3 beam width 3 at block size 5, tokens identical; tensor-parallel
# splits add only the order of the partial sums: 5.6e-3 to 8.4e-3).
TOLERANCE = {"float32": 1e-5, "float16": 2e-2}


def tiny_llama(dtype: str, device: str, kv_heads: int = 2, seed: int = 0) -> Any:
    config = transformers.LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=32,
                                      max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
                                      attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).to(device).eval()


def random_prompt(n: int, seed: int) -> Any:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed))


def search(beams: Any, prompt: Any, width: int, decisions: Any = None, *, steps: int) -> tuple[Any, Any, dict]:
    """``beam_search`` of ``steps`` steps, each step's logits kept (float32, on the CPU); ``decisions``: follow
    another search's choices (teacher-forced)."""
    logits: dict[int, Any] = {}
    tokens, chosen = beam_search(beams, prompt, width, steps, lambda s, lg: logits.__setitem__(s, lg.float().cpu()),
                                 follow=decisions)
    return tokens, chosen, logits


def relative(ours: dict, theirs: dict) -> float:
    """max |ours - theirs| over every step / the largest |theirs|."""
    scale = max(float(t.abs().max()) for t in theirs.values())
    return max(float((ours[s] - theirs[s]).abs().max()) for s in ours) / scale
