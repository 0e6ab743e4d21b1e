"""``PagedLlama``'s forward, tensor-parallel: N ranks, rank r holding the KV heads of its pool shard
(``client.attach(rank=r)``) and the matching slice of every layer's weights (Megatron / vLLM's split)::

    rank r:  q heads  Q_r = [r Hq / N, (r + 1) Hq / N)           the KV heads they read: the shard's ``heads``
             Wq, Wk, Wv  column-parallel: the rows of Q_r / of its KV heads (one fused GEMM, Q|K|V)
             Wo          row-parallel: the columns of Q_r                 -> a partial [T, hidden]
             Wgate, Wup  column-parallel: I / N rows, [r I / N, (r + 1) I / N)  (one fused GEMM)
             Wdown       row-parallel: the same I / N columns                  -> a partial [T, hidden]

    tokens --embed--> h                                 (replicated: embedding, norms, RoPE, LM head -- on the
    each layer:  x = norm(h) to every rank's device      home device, the model's, rank 0's)
                 rank r: q, k, v of its heads; kvpool::write_layer(its shard, ...); attend; o_r = o Wo_r
                 h += sum_r o_r  (the all-reduce: partials moved to the home device, added in rank order)
                 rank r: its slice of the MLP -> m_r;  h += sum_r m_r

More ranks than KV heads (``N % H == 0``, vLLM's rule): each rank holds one KV head, replicated N / H times; the
replicated ranks hold different q heads of its group (``Q_r`` always splits Hq by N), so every q head is attended
once and nothing is counted twice -- each of them writes the same KV into its own shard. Needs ``Hq % N == 0`` and
``I % N == 0`` (ValueError otherwise), no attention or MLP biases.

Ranks sit on their shards' devices. One process drives all N in a loop; with every rank on one device no op crosses
devices and a decode step is capturable as one CUDA graph; with several devices the ``.to(device)`` moves are real
peer copies (stream-ordered by PyTorch) and the engine runs eagerly. The elementwise helpers are ``layer_helpers``'
(``helpers`` names the set, as in ``PagedLlama``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

import kvpool_client.kernels.torch_ops as ops
from kvpool_client.integrations.layer_helpers import helpers as helper_set
from kvpool_client.kernels.prefill_attention import PrefillSpans, prefill_attention

TPAttend = Callable[[int, int, torch.Tensor], torch.Tensor]  # (rank, layer, q [T, Hq_r, D]) -> [T, Hq_r, D]


@dataclass
class Rank:
    """One rank: its shard ``blocks`` [num_blocks, L, 2, bs, len(kv_heads), D], its heads, its weight slices (one
    tensor a layer each, on ``blocks.device``), and its error flag (None: the engine's, on the same device)."""

    blocks: torch.Tensor
    q_heads: range
    kv_heads: range
    error: torch.Tensor | None
    qkv: list[torch.Tensor] = field(default_factory=list)
    o: list[torch.Tensor] = field(default_factory=list)
    gate_up: list[torch.Tensor] = field(default_factory=list)
    down: list[torch.Tensor] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.blocks.device


def q_heads_of(rank: int, num_heads: int, tensor_parallel: int) -> range:
    if num_heads % tensor_parallel:
        raise ValueError(f"{num_heads} attention heads do not split over {tensor_parallel} ranks")
    per = num_heads // tensor_parallel
    return range(rank * per, (rank + 1) * per)


class TPLlama:
    """The forward of ``hf_model`` (a ``LlamaForCausalLM``) over the shards ``shards`` (rank order), rank r holding
    the KV heads ``heads[r]`` of the full layout. The interface of ``PagedLlama``; its ``blocks`` / ``error``
    arguments are rank 0's (the engine's), the other ranks' are held here."""

    def __init__(self, hf_model: Any, shards: Sequence[torch.Tensor], heads: Sequence[range],
                 helpers: str = "eager") -> None:
        config = hf_model.config
        inner = hf_model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary, self.lm_head = inner.rotary_emb, hf_model.lm_head
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = float(self.layers[0].self_attn.scaling)
        self.eps = float(self.norm.variance_epsilon)
        if config.hidden_act != "silu":
            raise ValueError(f"TPLlama computes the MLP with SiLU, the model's is {config.hidden_act}")
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ValueError("TPLlama splits weights without biases; this model has attention or MLP biases")
        n, inter = len(shards), config.intermediate_size
        if inter % n:
            raise ValueError(f"the MLP's {inter} rows do not split over {n} ranks")
        self.home = self.embed.weight.device
        self.use_helpers(helpers)
        group = self.num_heads // self.num_kv_heads
        self.ranks: list[Rank] = []
        for r, (blocks, kv) in enumerate(zip(shards, heads)):
            q = q_heads_of(r, self.num_heads, n)
            if blocks.shape[4] != len(kv) or any(j // group not in kv for j in q):
                raise ValueError(f"rank {r}'s shard holds KV heads {kv} ({blocks.shape[4]} in its blocks); its q "
                                 f"heads {q} read heads {sorted({j // group for j in q})}")
            rank = Rank(blocks, q, kv, None if r == 0 or blocks.device == shards[0].device
                        else ops.new_error_flag(blocks.device))
            mlp_rows = slice(r * inter // n, (r + 1) * inter // n)
            for layer in self.layers:
                a, m = layer.self_attn, layer.mlp
                rank.qkv.append(self._to(rank, torch.cat([self._rows(a.q_proj.weight, q),
                                                          self._rows(a.k_proj.weight, kv),
                                                          self._rows(a.v_proj.weight, kv)])))
                rank.o.append(self._to(rank, a.o_proj.weight[:, q.start * self.head_dim:q.stop * self.head_dim]))
                rank.gate_up.append(self._to(rank, torch.cat([m.gate_proj.weight[mlp_rows],
                                                              m.up_proj.weight[mlp_rows]])))
                rank.down.append(self._to(rank, m.down_proj.weight[:, mlp_rows]))
            self.ranks.append(rank)
        self.several_devices = len({rank.device for rank in self.ranks}) > 1

    def _on(self, rank: Rank) -> AbstractContextManager[Any]:
        """Rank ``rank``'s device made current while its work is enqueued (Triton and the slot kernels launch on
        the current device); nothing when every rank shares one device (nothing to switch; graph capture)."""
        return torch.cuda.device(rank.device) if self.several_devices and rank.device.type == "cuda" else nullcontext()

    def _rows(self, weight: torch.Tensor, heads: range) -> torch.Tensor:
        return weight[heads.start * self.head_dim:heads.stop * self.head_dim]

    @staticmethod
    def _to(rank: Rank, weight: torch.Tensor) -> torch.Tensor:
        return weight.detach().to(rank.device).contiguous()

    @property
    def devices(self) -> list[torch.device]:
        return [rank.device for rank in self.ranks]

    def use_helpers(self, name: str) -> None:
        self.f = helper_set(name)
        self.helpers = name

    def errors(self) -> list[torch.Tensor]:
        """The error flags held here (the ranks on devices other than rank 0's)."""
        return [rank.error for rank in self.ranks if rank.error is not None]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor,
                error: torch.Tensor, attend: TPAttend, keep: torch.Tensor | None = None) -> torch.Tensor:
        t, f, eps, d = ids.shape[0], self.f, self.eps, self.head_dim
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions[None])
        cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, D]
        inputs = [(slots.to(r.device), cos.to(r.device), sin.to(r.device), r.error if r.error is not None
                   else error) for r in self.ranks]
        x = f["rms_norm"](h, self.layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(self.layers):
            partial: torch.Tensor | None = None
            for r, (rank, (rank_slots, c, s, err)) in enumerate(zip(self.ranks, inputs)):
                hq, hkv = len(rank.q_heads), len(rank.kv_heads)
                with self._on(rank):
                    q, k, v = torch.nn.functional.linear(x.to(rank.device), rank.qkv[i]).split(
                        [hq * d, hkv * d, hkv * d], -1)
                    q, k = f["rope"](q.view(t, hq, d), k.view(t, hkv, d), c, s)
                    torch.ops.kvpool.write_layer(rank.blocks, i, rank_slots, k, v.view(t, hkv, d), err)
                    o = torch.nn.functional.linear(attend(r, i, q).reshape(t, hq * d), rank.o[i]).to(self.home)
                partial = o if partial is None else partial + o  # the all-reduce, in rank order
            assert partial is not None
            h, x = f["add_rms_norm"](partial, h, layer.post_attention_layernorm.weight, eps)
            partial = None
            for rank in self.ranks:
                with self._on(rank):
                    gate_up = torch.nn.functional.linear(x.to(rank.device), rank.gate_up[i])
                    y = torch.nn.functional.linear(f["silu_mul"](gate_up), rank.down[i]).to(self.home)
                partial = y if partial is None else partial + y
            assert partial is not None
            last = i + 1 == len(self.layers)
            h, x = f["add_rms_norm"](partial, h, (self.norm if last else self.layers[i + 1].input_layernorm).weight,
                                     eps)
        if keep is not None:
            x = x[keep]
        return self.lm_head(x)

    def decode_attend(self, blocks: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> TPAttend:
        """One query token per sequence, each rank over its shard through the same block tables."""
        per = [(block_tables.to(r.device), seq_lens.to(r.device)) for r in self.ranks]

        def attend(rank: int, layer: int, q: torch.Tensor) -> torch.Tensor:
            return torch.ops.kvpool.paged_decode(q, self.ranks[rank].blocks, layer, *per[rank], self.scale)
        return attend

    def prefill_attend(self, blocks: torch.Tensor, error: torch.Tensor,
                       spans: list[tuple[int, int, torch.Tensor]]) -> TPAttend:
        """``PagedLlama.prefill_attend`` a rank: every sequence's context gathered from the rank's shard."""
        packed = PrefillSpans.of(spans)
        per = [packed.to(r.device) for r in self.ranks]

        def attend(rank: int, layer: int, q: torch.Tensor) -> torch.Tensor:
            r = self.ranks[rank]
            return prefill_attention(q, r.blocks, layer, per[rank], r.error if r.error is not None else error,
                                     len(r.q_heads) // len(r.kv_heads), self.scale)
        return attend
