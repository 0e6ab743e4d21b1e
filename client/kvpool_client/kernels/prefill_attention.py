"""Causal attention of a prefill over the pool: several sequences' new tokens, each attending to its whole context
(a cached run, earlier chunks, then the new tokens themselves), the context's KV read from the pool.

    spans = PrefillSpans.of([(first row in q, new tokens n, context slots [m], the new ones last), ...])
    o = prefill_attention(q, blocks, layer, spans, error, group, scale)      # q, o: [T, Hq, D]

Per layer, one ``kvpool::read_layer`` gathers every sequence's context (the slots of all spans, concatenated once
per prefill), then

- on CUDA, fp16 / bf16, head size a multiple of 8 up to 256: one varlen FlashAttention call over all the spans
  (``aten::_flash_attention_forward``, the kernel behind SDPA's flash backend, given the cumulative lengths):
  causal aligned to the bottom right (query i of a span of n over a context of m sees keys 0 .. m - n + i), KV
  heads shared by ``group`` query heads inside the kernel (no repeat), no score matrix in memory; a single span of
  few new tokens over a long context is split over its keys instead (``split_kv``: one Triton launch, or two
  flash calls, and a merge);
- elsewhere (the CPU, float32, a build without flash), per span: the KV heads repeated ``group`` times and SDPA
  with the boolean causal mask offset to the new tokens' positions (PyTorch's math path).

Both compute the same attention (on the H200, fp16, 4,352 queries over 4,352 keys of unit-normal data: largest
difference 2e-3 between them; the engines' logit tests hold either). SDPA given ``causal_lower_right`` runs the math path for n < m on the H200 (torch
2.11, measured), which is why the flash kernel is called directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpool_client.kernels.split_kv import SplitPlan, split_attention, split_plan

FLASH_DTYPES = (torch.float16, torch.bfloat16)
_flash_broken: set[str] = set()  # devices where the flash call raised once: the fallback from then on
_split_broken: set[str] = set()  # devices where the split-KV calls raised once: one flash call from then on


@dataclass(frozen=True)
class PrefillSpans:
    """One prefill's sequences: ``spans`` as given; ``context`` every span's context slots, concatenated;
    ``cu_q`` / ``cu_k`` the cumulative new-token and context lengths (int32, [S + 1], on the device; ``starts_k``
    the latter on the host), ``max_q`` / ``max_k`` the longest of each; ``plans`` the split-KV plan by query heads
    (``split_kv``, made by the first layer). Built once per prefill, read by every layer."""

    spans: list[tuple[int, int, torch.Tensor]]
    context: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    starts_k: list[int]
    max_q: int
    max_k: int
    plans: dict[int, SplitPlan | None] = field(default_factory=dict, compare=False, repr=False)

    def split(self, num_heads: int, device: torch.device) -> SplitPlan | None:
        if num_heads not in self.plans:
            self.plans[num_heads] = split_plan(self, num_heads, device)
        return self.plans[num_heads]

    @classmethod
    def of(cls, spans: list[tuple[int, int, torch.Tensor]]) -> PrefillSpans:
        if not spans:
            raise ValueError("a prefill has at least one sequence")
        device = spans[0][2].device
        rows, lens_q, lens_k = 0, [0], [0]
        for start, n, ctx in spans:
            if start != rows or not 0 < n <= ctx.shape[0]:
                raise ValueError("prefill spans must be consecutive rows of q, each of 1..len(context) new tokens")
            rows += n
            lens_q.append(lens_q[-1] + n)
            lens_k.append(lens_k[-1] + int(ctx.shape[0]))
        return cls(spans, torch.cat([ctx for _, _, ctx in spans]) if len(spans) > 1 else spans[0][2],
                   torch.tensor(lens_q, dtype=torch.int32, device=device),
                   torch.tensor(lens_k, dtype=torch.int32, device=device), lens_k,
                   max(n for _, n, _ in spans), max(int(ctx.shape[0]) for _, _, ctx in spans))

    def to(self, device: torch.device) -> PrefillSpans:
        """The same spans with their tensors on ``device`` (a tensor-parallel rank's)."""
        return PrefillSpans([(s, n, ctx.to(device)) for s, n, ctx in self.spans], self.context.to(device),
                            self.cu_q.to(device), self.cu_k.to(device), self.starts_k, self.max_q, self.max_k)


def flash_supported(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether ``prefill_attention`` takes the varlen flash kernel for CUDA tensors of this dtype, head size and
    device (False once the kernel raised there)."""
    return (device.type == "cuda" and dtype in FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= 256
            and str(device) not in _flash_broken and torch.backends.cuda.flash_sdp_enabled())


def uses_flash(q: torch.Tensor) -> bool:
    """Whether ``prefill_attention`` takes the varlen flash kernel for this query tensor."""
    return flash_supported(q.dtype, q.shape[-1], q.device)


def prefill_attention(q: torch.Tensor, blocks: torch.Tensor, layer: int, spans: PrefillSpans,
                      error: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """The attention output of ``q`` [T, Hq, D] (T = the spans' new tokens, in span order), [T, Hq, D]."""
    k, v = torch.ops.kvpool.read_layer(blocks, layer, spans.context, error)  # [sum m, Hkv, D] each
    if uses_flash(q):
        try:
            plan = None if str(q.device) in _split_broken else spans.split(q.shape[1], q.device)
            if plan is not None:
                try:
                    return split_attention(q, k, v, plan, scale)
                except RuntimeError:  # a kernel whose log-sum-exp is not what split_kv reads: one call from now on
                    _split_broken.add(str(q.device))
            return torch.ops.aten._flash_attention_forward(
                q, k, v, spans.cu_q, spans.cu_k, spans.max_q, spans.max_k, 0.0, True, False, scale=scale)[0]
        except RuntimeError:  # a build or device without the kernel: the math path, for good on this device
            _flash_broken.add(str(q.device))
    return _math_attention(q, k, v, spans, group, scale)


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: PrefillSpans, group: int,
                    scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    cu_k = spans.starts_k
    for i, (start, n, _) in enumerate(spans.spans):
        ks = k[cu_k[i]:cu_k[i + 1]].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, m, D]
        vs = v[cu_k[i]:cu_k[i + 1]].repeat_interleave(group, dim=1).transpose(0, 1)
        m = ks.shape[1]
        allowed = (torch.arange(m, device=q.device)[None, :]
                   <= (m - n + torch.arange(n, device=q.device))[:, None])
        o = torch.nn.functional.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), ks, vs,
                                                             attn_mask=allowed, scale=scale)
        out[start:start + n] = o.transpose(0, 1)
    return out
