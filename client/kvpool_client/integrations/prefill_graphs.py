"""CUDA graphs of a one-sequence prefill: the fixed cost of a short prefill (a cache hit's suffix) cut from ~1,300
kernel launches and ~64 custom-op calls on the host to one replay.

    graphs = PrefillGraphs(model, blocks, error, scratch_slot, max_context)
    logits = graphs.run(ids, positions, slots, context)      None: no graph for this size (the caller runs eagerly)

A graph is captured at the first prefill of its bucket -- (new tokens rounded up to a power of two, at least 16 and
at most ``max_tokens``; context rounded up likewise, at least 256, and above CONTEXT_FINE_FROM to a sixteenth of its
power of two: 4,352 -> 4,608, not 8,192, so a 4,096-token hit's gather reads 6% more slots than it needs, not 88%)
-- and replayed for every later prefill of that bucket. Its static inputs are filled before each replay:

    ids, positions, slots  [T_b]   the new tokens; rows n..T_b padding: token 0, position 0, the scratch slot
    context                [C_b]   the span's context slots (cached run, then the new tokens), then padding rows'
                                   scratch slot (their own keys), then the scratch slot to the end (never read)
    cu_q = [0, T_b], cu_k = [0, m + T_b - n]                         one span: the real queries first, padding after
    keep = [n - 1]                                                   the last real token's logits

The padding queries come after the real ones and their keys after the real keys, so bottom-right causal alignment
gives each real query exactly the keys it sees unpadded (query i: keys 0 .. m - n + i); the padding rows attend to
whatever, write only the scratch slot and are never read. Only the flash path is captured (its lengths come from
``cu_k`` on the device; the math path reads them on the host).

Bounds: at most ``len(token buckets) x len(context buckets)`` graphs (16..1024 tokens: 7; 256..max_context: one per
power of two up to CONTEXT_FINE_FROM, eight per power of two above it), sharing one memory pool whose size is that
of the largest bucket's forward; a bucket whose capture fails is run eagerly from then on.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from kvpool_client.kernels.prefill_attention import PrefillSpans, flash_supported

MIN_TOKENS, MIN_CONTEXT, MAX_TOKENS = 16, 256, 1024
CONTEXT_FINE_FROM = 2048  # contexts above this round up to a sixteenth of their power of two


def bucket(n: int, least: int) -> int:
    return max(least, 1 << (int(n) - 1).bit_length())


def context_bucket(n: int) -> int:
    """The context size a graph is captured for: ``bucket(n, MIN_CONTEXT)`` up to CONTEXT_FINE_FROM, above it
    ``n`` rounded up to a multiple of a sixteenth of that power of two (eight buckets an octave)."""
    b = bucket(n, MIN_CONTEXT)
    if b <= CONTEXT_FINE_FROM:
        return b
    step = b >> 4
    return -(-int(n) // step) * step


class _Graph:
    def __init__(self, tokens: int, context: int, device: torch.device) -> None:
        def z(n: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)
        self.ids, self.positions, self.slots, self.context = z(tokens), z(tokens), z(tokens), z(context)
        self.cu_q = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        self.cu_k, self.keep = z(2, torch.int32), z(1)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None


class PrefillGraphs:
    """Invariant: a captured graph's static inputs hold the last prefill it ran (or the capture's scratch-slot
    inputs); every replay refills all of them first, so nothing of an earlier prompt reaches a later one."""

    def __init__(self, model: Any, blocks: torch.Tensor, error: torch.Tensor, scratch_slot: int,
                 max_context: int, max_tokens: int = MAX_TOKENS) -> None:
        self.model, self.blocks, self.error = model, blocks, error
        self.scratch_slot, self.max_tokens = scratch_slot, max_tokens
        self.max_context = context_bucket(max_context + max_tokens)
        self.device = blocks.device
        self.graphs: dict[tuple[int, int], _Graph | None] = {}  # None: its capture failed, eager from then on
        self._pool: Any = None
        self.enabled = flash_supported(blocks.dtype, blocks.shape[5], self.device)

    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, context: np.ndarray) -> torch.Tensor | None:
        """The logits [1, V] of the last of ``ids`` (one sequence's new tokens at ``positions``, written to
        ``slots``; ``context`` its whole context's slots, the new ones last), or None when no graph serves it."""
        n, m = len(ids), len(context)
        if not self.enabled or n > self.max_tokens:
            return None
        t_b = bucket(n, MIN_TOKENS)
        c_b = context_bucket(m + t_b - n)
        if c_b > self.max_context:
            return None
        key = (t_b, c_b)
        if key not in self.graphs:
            self.graphs[key] = self._capture(t_b, c_b)
        g = self.graphs[key]
        if g is None:
            return None
        pad = t_b - n
        host = torch.from_numpy
        g.ids.copy_(host(np.concatenate([np.asarray(ids, dtype=np.int64), np.zeros(pad, dtype=np.int64)])))
        g.positions.copy_(host(np.concatenate([np.asarray(positions, dtype=np.int64), np.zeros(pad, np.int64)])))
        g.slots.copy_(host(np.concatenate([np.asarray(slots, dtype=np.int64),
                                           np.full(pad, self.scratch_slot, dtype=np.int64)])))
        ctx = np.full(c_b, self.scratch_slot, dtype=np.int64)
        ctx[:m] = context
        g.context.copy_(host(ctx))
        g.cu_k.copy_(host(np.array([0, m + pad], dtype=np.int32)))
        g.keep.fill_(n - 1)
        g.graph.replay()
        assert g.logits is not None
        return g.logits.clone()

    def _forward(self, g: _Graph, t_b: int, c_b: int) -> torch.Tensor:
        spans = PrefillSpans([(0, t_b, g.context)], g.context, g.cu_q, g.cu_k, [0, c_b], t_b, c_b)
        attend = self.model.prefill_attend(self.blocks, self.error, spans)
        return self.model.forward(g.ids, g.positions, g.slots, self.blocks, self.error, attend, g.keep)

    def _capture(self, t_b: int, c_b: int) -> _Graph | None:
        g = _Graph(t_b, c_b, self.device)
        g.slots.fill_(self.scratch_slot)
        g.context.fill_(self.scratch_slot)
        g.cu_k.copy_(torch.tensor([0, t_b], dtype=torch.int32))
        try:
            self._forward(g, t_b, c_b)  # every kernel compiled / autotuned outside the capture
            torch.cuda.synchronize(self.device)
            if not flash_supported(self.blocks.dtype, self.blocks.shape[5], self.device):
                raise RuntimeError("the flash kernel failed: only the flash path can be captured")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                g.logits = self._forward(g, t_b, c_b)
        except Exception as e:  # noqa: BLE001  (any capture failure: this bucket runs eagerly)
            warnings.warn(f"prefill graph capture of ({t_b} tokens, {c_b} context) failed ({e!r:.300}); "
                          "that bucket runs eagerly", stacklevel=3)
            return None
        self._pool = graph.pool() if self._pool is None else self._pool
        g.graph = graph
        return g
