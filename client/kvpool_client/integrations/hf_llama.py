"""A Hugging Face ``LlamaForCausalLM`` whose KV cache is kvpool: per-layer writes into the pool, attention read
from the pool through block tables, beams forked on the server (copy-on-write).

    prompt  --register + append(P)-->  slots          the server allocates blocks, the model writes K/V:
    forward(prompt)  each layer:  pool.write_layer(layer, slots, k, v)      (one kernel, the torch stream)
                                  paged_prefill_attention(q, K_l, V_l, block_table, seq_len)
    step    --append(seqs, 1)-->  slots (copy-on-write already done by the server); block tables kept here from them
    forward(tokens)  each layer:  pool.write_layer(...);  paged_decode_attention(q, K_l, V_l, tables, lens)
    beam    --fork(parent, k)-->  children share every block; the next append copies the shared last block

The model is unchanged: ``transformers``' attention interface is pointed at ``kvpool_attention`` (registered under
the name "kvpool") while ``KVPoolLlama`` runs a forward, with ``use_cache=False`` so transformers keeps no cache of
its own; each forward's slots and block tables travel in a context variable.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvpool.layout import KVLayout
from kvpool_client.kernels import torch_views
from kvpool_client.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

ATTN_NAME = "kvpool"


def continue_beams(seqs: list[int], parents: list[int], fork: Callable[[int, int], list[int]],
                   free: Callable[[list[int]], Any]) -> list[int]:
    """The sequences of the next beams: beam i continues ``seqs[parents[i]]`` -- the first beam of a parent keeps
    its sequence, the others are forks of it (copy-on-write), and parents no beam continues are freed."""
    uses: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        uses.setdefault(p, []).append(i)
    new = [0] * len(parents)
    unused = [s for j, s in enumerate(seqs) if j not in uses]
    for p, beams in uses.items():
        children = fork(seqs[p], len(beams) - 1)
        for i, seq in zip(beams, [seqs[p], *children]):
            new[i] = seq
    free(unused)
    return new


@dataclass
class _Step:
    """What one forward's attention layers need: where the new tokens go and every sequence's context."""

    pool: Any
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V views of the pool
    slots: torch.Tensor  # int64 [B * q_len], token-major (sequence b's tokens together)
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B], after this forward's tokens
    seq_lens_host: list[int]


_ACTIVE: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("kvpool_step", default=None)


def kvpool_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, Hq, S, D], key/value [B, Hkv, S, D] (this forward's tokens
    only) -> [B, S, Hq, D]. Writes the new K/V into the pool, then attends over the pool."""
    step = _ACTIVE.get()
    if step is None:
        raise RuntimeError("kvpool_attention runs only inside KVPoolLlama's forward")
    layer = module.layer_idx
    batch, num_heads, q_len, head_dim = query.shape
    k_new = key.transpose(1, 2).reshape(batch * q_len, key.shape[1], head_dim)
    v_new = value.transpose(1, 2).reshape(batch * q_len, value.shape[1], head_dim)
    step.pool.write_layer(layer, step.slots, k_new, v_new)
    k_cache, v_cache = step.kv[layer]
    if q_len == 1:
        out = paged_decode_attention(query[:, :, 0].contiguous(), k_cache, v_cache, step.block_tables,
                                     step.seq_lens, scaling)
        return out.unsqueeze(1), None
    outs = [paged_prefill_attention(query[b].transpose(0, 1), k_cache, v_cache, step.block_tables[b],
                                    step.seq_lens_host[b], scaling) for b in range(batch)]
    return torch.stack(outs), None


def register() -> None:
    from transformers import AttentionInterface  # noqa: PLC0415

    AttentionInterface.register(ATTN_NAME, kvpool_attention)


def layout_for(config: Any, block_size: int = 16, dtype: str = "float16",
               kv_layout: str = "block-major") -> KVLayout:
    """The pool layout a server needs to hold this model's KV."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVLayout(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                    head_dim=head_dim, block_size=block_size, dtype=dtype, kv_layout=kv_layout)


class KVPoolLlama:
    """Runs ``model`` with its KV in the pool of ``client``'s server (attached here). Sequences are the server's."""

    def __init__(self, model: Any, client: Any) -> None:
        register()
        self.model = model
        self.client = client
        self.pool = client.attach()
        self.device = next(model.parameters()).device
        expected = layout_for(model.config, self.pool.layout.block_size, self.pool.layout.dtype,
                              self.pool.layout.kv_layout)
        if expected != self.pool.layout:
            raise ValueError(f"the server's layout {self.pool.layout} does not hold this model's KV ({expected})")
        whole = torch_views.blocks(self.pool)
        self.kv = [torch_views.layer_kv(self.pool, layer, whole) for layer in range(self.pool.layout.num_layers)]
        self._known: dict[int, tuple[list[int], int]] = {}  # seq -> (block ids, tokens), from Append replies

    @contextlib.contextmanager
    def _attention(self, step: _Step) -> Iterator[None]:
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTN_NAME
        token = _ACTIVE.set(step)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            config._attn_implementation = previous

    def _tables(self, seq_ids: list[int], slots: np.ndarray, q_len: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 list[int]]:
        """Block tables and lengths after an Append of ``q_len`` tokens to each of ``seq_ids`` (``slots`` its
        reply). Kept here, not asked for: token ``pos`` lives in block ``slots // block_size``, so the reply names
        every block that changed (new blocks, and a shared last block replaced by its copy-on-write copy); the
        blocks before are the sequence's own and never move. One BlockTable RPC only for a sequence not seen yet
        (registered elsewhere, or forked from one not seen)."""
        bs = self.pool.layout.block_size
        for i, seq in enumerate(seq_ids):
            table = self._known.get(seq)
            if table is None:
                t = self.client.block_table(seq)
                self._known[seq] = ([int(b) for b in t.block_ids], int(t.num_tokens))
                continue
            blocks, n = table
            for j, slot in enumerate(slots[i * q_len : (i + 1) * q_len].tolist()):
                idx = (n + j) // bs
                if idx == len(blocks):
                    blocks.append(slot // bs)
                else:
                    blocks[idx] = slot // bs
            self._known[seq] = (blocks, n + q_len)
        tables = [self._known[s] for s in seq_ids]
        width = max(len(b) for b, _ in tables)
        padded = np.zeros((len(tables), width), dtype=np.int32)
        for i, (b, _) in enumerate(tables):
            padded[i, : len(b)] = b
        lens = [n for _, n in tables]
        return (torch.from_numpy(padded).to(self.device), torch.tensor(lens, dtype=torch.int32, device=self.device),
                lens)

    @torch.no_grad()
    def forward(self, seq_ids: list[int], input_ids: torch.Tensor) -> torch.Tensor:
        """Append ``input_ids`` [B, S] to sequences ``seq_ids`` (same S each) and return their logits [B, S, V].
        One RPC (Append) per call once the sequences are known here."""
        batch, q_len = input_ids.shape
        result = self.client.append(seq_ids, q_len)
        host_slots = np.asarray(result.slot_mapping, dtype=np.int64)
        slots = torch.from_numpy(host_slots).to(self.device)
        tables, lens, lens_host = self._tables(seq_ids, host_slots, q_len)
        positions = torch.tensor([[n - q_len + i for i in range(q_len)] for n in lens_host], device=self.device)
        step = _Step(self.pool, self.kv, slots, tables, lens, lens_host)
        with self._attention(step):
            out = self.model(input_ids=input_ids.to(self.device), position_ids=positions, use_cache=False)
        return out.logits

    def register(self) -> int:
        seq = self.client.register()
        self._known[seq] = ([], 0)
        return seq

    def fork(self, parent: int, num_children: int) -> list[int]:
        children = self.client.fork(parent, num_children) if num_children else []
        if parent in self._known:  # children share every block of the parent until they append
            blocks, n = self._known[parent]
            for child in children:
                self._known[child] = (list(blocks), n)
        return children

    def free(self, seq_ids: list[int]) -> None:
        if seq_ids:
            self.client.free(seq_ids)
            for seq in seq_ids:
                self._known.pop(seq, None)


# --- decoding: one algorithm, two KV stores (the pool, or transformers' dense recompute as the reference) -------

class PagedBeams:
    """Beams as kvpool sequences: ``start`` prefills, ``step`` forks parents and decodes one token each."""

    def __init__(self, runner: KVPoolLlama) -> None:
        self.runner = runner
        self.seqs: list[int] = []

    def start(self, prompt: torch.Tensor) -> torch.Tensor:
        seq = self.runner.register()
        self.seqs = [seq]
        return self.runner.forward([seq], prompt[None])[0, -1]

    def step(self, parents: list[int], tokens: list[int]) -> torch.Tensor:
        """New beams: beam i continues beam ``parents[i]`` with ``tokens[i]``. Returns logits [W, V]."""
        new = self.seqs = continue_beams(self.seqs, parents, self.runner.fork, self.runner.free)
        ids = torch.tensor(tokens, dtype=torch.long)[:, None]
        return self.runner.forward(new, ids)[:, -1]

    def close(self) -> None:
        self.runner.free(self.seqs)
        self.seqs = []


class DenseBeams:
    """The reference: each beam's whole token list through the unmodified model (its own attention, no cache)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.beams: list[list[int]] = []

    @torch.no_grad()
    def _logits(self) -> torch.Tensor:
        ids = torch.tensor(self.beams, dtype=torch.long, device=self.device)
        return self.model(input_ids=ids, use_cache=False).logits[:, -1]

    def start(self, prompt: torch.Tensor) -> torch.Tensor:
        self.beams = [prompt.tolist()]
        return self._logits()[0]

    def step(self, parents: list[int], tokens: list[int]) -> torch.Tensor:
        self.beams = [self.beams[p] + [t] for p, t in zip(parents, tokens)]
        return self._logits()

    def close(self) -> None:
        self.beams = []


def beam_search(beams: Any, prompt: torch.Tensor, width: int, steps: int,
                on_logits: Callable[[int, torch.Tensor], None] | None = None,
                follow: list[tuple[list[int], list[int]]] | None = None) -> tuple[list[list[int]], list]:
    """Beam search by cumulative log-probability (no EOS, no length penalty); width 1 is greedy decoding.

    ``on_logits(step, logits [W, V])`` sees every step's logits. ``follow``: replay these (parents, tokens)
    decisions instead of choosing (teacher forcing: a reference computes its logits on the same beams). Returns the
    generated tokens of each beam, best first, and the (parents, tokens) decision of every step."""
    logits = beams.start(prompt)[None]
    scores = torch.zeros(1, dtype=torch.float64)
    history: list[list[int]] = [[]]
    decisions: list[tuple[list[int], list[int]]] = []
    for step in range(steps):
        if on_logits is not None:
            on_logits(step, logits)
        logp = torch.log_softmax(logits.double().cpu(), dim=-1) + scores[:, None]
        vocab = logp.shape[1]
        if follow is None:
            top = torch.topk(logp.reshape(-1), width)
            parents, tokens = (top.indices // vocab).tolist(), (top.indices % vocab).tolist()
        else:
            parents, tokens = follow[step]
        scores = logp[parents, tokens]
        decisions.append((parents, tokens))
        history = [history[p] + [t] for p, t in zip(parents, tokens)]
        if step + 1 < steps:
            logits = beams.step(parents, tokens)
    beams.close()
    return history, decisions
