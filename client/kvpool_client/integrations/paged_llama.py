"""A Llama-family forward over a flat batch of tokens, its KV in a paged cache (the pool, or an in-process cache of
the same shape) through ``torch.ops.kvpool``. The weights are a transformers ``LlamaForCausalLM``'s modules,
used as they are (embedding, norms, projections, MLP, rotary embedding, LM head); only attention is replaced:

    tokens [T] --embed--> h [T, hidden]
    each layer:  q, k, v = projections(norm(h)), RoPE at ``positions``
                 kvpool::write_layer(blocks, layer, slots, k, v)         the new tokens' KV into their slots
                 o = attend(layer, q)                                    decode: kvpool::paged_decode through the
                 h += o_proj(o);  h += mlp(norm(h))                      block tables; prefill: gather + flash
    logits = lm_head(norm(h[keep]))

The decode path is what an engine captures in a CUDA graph: every tensor it reads is a static buffer, no op
synchronizes with the host. The elementwise parts (residual add + RMSNorm, RoPE, SiLU-and-multiply) are written
by ``layer_helpers``: eager (op for op as transformers computes them), ``torch.compile``d, or Liger-Kernel's
Triton kernels (one kernel each instead of ~8, ~12 and 2), which matters once a step is a graph replay of ~40
kernels a layer. ``fused`` (the default): Q, K, V in one GEMM and
gate, up in another, over concatenated copies of the weights (Llama-3-8B: +9 GiB), V written to the pool straight
from its strided view of the QKV output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvpool_client.integrations.layer_helpers import helpers as helper_set
from kvpool_client.kernels.prefill_attention import PrefillSpans, prefill_attention

Attend = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, q [T, Hq, D]) -> [T, Hq, D]


class PagedLlama:
    """The forward of ``hf_model`` (a ``LlamaForCausalLM``, or a model of the same module structure)."""

    def __init__(self, hf_model: Any, helpers: str = "eager", fused: bool = True) -> None:
        config = hf_model.config
        inner = hf_model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary, self.lm_head = inner.rotary_emb, hf_model.lm_head
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = float(self.layers[0].self_attn.scaling)
        self.eps = float(self.norm.variance_epsilon)
        self._qkv_split = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                           self.num_kv_heads * self.head_dim]
        if config.hidden_act != "silu":
            raise ValueError(f"PagedLlama computes the MLP with SiLU, the model's is {config.hidden_act}")
        self.use_helpers(helpers)
        # one GEMM for Q, K and V, one for gate and up (copies of the weights: +(Hq + 2 Hkv) D + 2 I rows of
        # ``hidden`` a layer; transformers' own modules keep theirs)
        self.fused = fused and not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False)
        self.qkv: list[torch.Tensor] = []
        self.gate_up: list[torch.Tensor] = []
        if self.fused:
            for layer in self.layers:
                a, m = layer.self_attn, layer.mlp
                self.qkv.append(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach())
                self.gate_up.append(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach())

    def use_helpers(self, name: str) -> None:
        self.f = helper_set(name)
        self.helpers = name

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor,
                error: torch.Tensor, attend: Attend, keep: torch.Tensor | None = None) -> torch.Tensor:
        t, f, eps = ids.shape[0], self.f, self.eps
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions[None])
        cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, D]
        x = f["rms_norm"](h, self.layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if self.fused:
                q, k, v = torch.nn.functional.linear(x, self.qkv[i]).split(self._qkv_split, -1)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)  # a strided view when fused: write_layer takes it
            q, k = f["rope"](q, k, cos, sin)
            torch.ops.kvpool.write_layer(blocks, i, slots, k, v, error)
            o = attend(i, q)
            h, x = f["add_rms_norm"](attn.o_proj(o.reshape(t, self.num_heads * self.head_dim)), h,
                                     layer.post_attention_layernorm.weight, eps)
            if self.fused:
                gate_up = torch.nn.functional.linear(x, self.gate_up[i])
            else:
                gate_up = torch.cat((mlp.gate_proj(x), mlp.up_proj(x)), -1)
            y = mlp.down_proj(f["silu_mul"](gate_up))
            last = i + 1 == len(self.layers)
            h, x = f["add_rms_norm"](y, h, (self.norm if last else self.layers[i + 1].input_layernorm).weight, eps)
        if keep is not None:
            x = x[keep]
        return self.lm_head(x)

    def decode_attend(self, blocks: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> Attend:
        """One query token per sequence, the context through the block tables (Triton on CUDA)."""
        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            return torch.ops.kvpool.paged_decode(q, blocks, layer, block_tables, seq_lens, self.scale)
        return attend

    def prefill_attend(self, blocks: torch.Tensor, error: torch.Tensor,
                       spans: list[tuple[int, int, torch.Tensor]] | PrefillSpans) -> Attend:
        """Several sequences' new tokens, concatenated: ``spans`` = (first row in q, new tokens, context slots
        [n_ctx], the new ones last). Each layer gathers every context at once (``kvpool::read_layer``), then
        causal attention offset to the new tokens' positions (``kernels/prefill_attention.py``: varlen
        FlashAttention on CUDA, SDPA's math path elsewhere)."""
        group = self.num_heads // self.num_kv_heads
        packed = spans if isinstance(spans, PrefillSpans) else PrefillSpans.of(spans)

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            return prefill_attention(q, blocks, layer, packed, error, group, self.scale)
        return attend
