"""A compact decode engine whose KV lives in kvpool's pool (nano-vllm's model runner is the model): static input
buffers, one CUDA graph per batch bucket; a one-sequence prefill of up to 1,024 tokens replayed from a graph of its
size bucket (``prefill_graphs``), larger and batched ones eager (varlen FlashAttention over the pool); on the CPU
everything runs eagerly.

    plan_decode(seqs)      the control path, on the host: Append(seqs, 1) -> slots (kvpool: one RPC; the
                           baseline: an in-process allocator), block tables updated from the reply (``SeqTables``),
                           slot range checked, the step's inputs written to pinned staging (two sets, alternating)
    run_decode(plan, ids)  the data path, on the device: staging -> static buffers (async H2D), then one graph
                           replay (write_layer + paged_decode of every layer, ``torch.ops.kvpool``) -> logits

``generate`` overlaps them: step t+1's plan (its slots do not depend on step t's tokens) runs on the host while step
t's graph runs on the device, so the control path costs nothing while it is shorter than a step.

A batch of B runs in the smallest captured bucket >= B; the padding rows write into, and attend over, one slot of
the engine's own scratch sequence (registered at start, one block), so a padded step touches nobody's KV.
Out-of-pool slots: an Append reply outside the pool is refused when the step is planned; what reaches a kernel
anyway raises ``error`` on the device, read by ``check_errors`` (``generate`` calls it once per call).

Prefix caching (``engine_prompts``): ``generate`` registers each prompt with its token ids (``add_prompt``; the
salt is the caller's tenant, ``cache_key`` an optional extra key), starts it with the cached run the server reports
and prefills only the rest; the first append after a prefill waits for its writes (``WriteFence``), so no block
is sealed -- matchable by another frontend -- before its KV is written.

Two variants, one engine: ``DecodeEngine.on_pool(model, client)`` (control through ``KVPoolClient``, KV in the
attached pool) and ``DecodeEngine.in_process(model, num_blocks, block_size)`` (``LocalBlockCache`` over a
``torch.zeros`` cache of the same shape) -- the fair baseline.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kvpool_client.kernels.torch_ops as ops
from kvpool_client.integrations.engine_prompts import WriteFence, register_prompt
from kvpool_client.integrations.layer_helpers import default_helpers
from kvpool_client.integrations.local_cache import LocalBlockCache, zeros_like_pool
from kvpool_client.integrations.paged_llama import PagedLlama
from kvpool_client.integrations.prefill_graphs import PrefillGraphs
from kvpool_client.integrations.seq_tables import SeqTables
from kvpool_client.integrations.streamed_appends import StreamedAppends, control_path
from kvpool_client.kernels import torch_views


@dataclass
class DecodePlan:
    seqs: list[int]
    bucket: int  # rows the step runs (>= len(seqs))
    turn: int  # which of the two staging sets holds its inputs


class DecodeEngine:
    PREFILL_GRAPHS = True  # whether this engine's forward can be captured as a prefill graph (TP: not yet)

    def __init__(self, model: Any, control: Any, blocks: torch.Tensor, *, max_batch: int = 256,
                 max_model_len: int = 4096, graph_sizes: Sequence[int] | None = None,
                 live_check: Callable[[], None] | None = None, pool: Any = None,
                 helpers: str | None = None, prefill_graphs: bool | None = None) -> None:
        """``helpers``: the layers' elementwise kernels (``layer_helpers.NAMES``; default ``default_helpers``)."""
        self.model = self._paged_model(model, helpers or default_helpers(blocks.device))
        self.control, self.blocks, self.pool = control, blocks, pool
        self.live_check = live_check or (lambda: None)
        self.device = blocks.device
        self.block_size = blocks.shape[3]
        self.num_slots = blocks.shape[0] * self.block_size
        self.error = ops.new_error_flag(self.device)
        self.fence = WriteFence()
        # prefill appends carry token ids, which the append stream does not: they go through the client itself
        self.prompt_control = control.client if isinstance(control, StreamedAppends) else control
        self.prompt_tokens = self.cached_tokens = 0  # prompts' tokens registered, and of those served cached
        max_blocks = -(-max_model_len // self.block_size)
        self.tables = SeqTables(4 * max_batch + 1, max_blocks, self.block_size)
        self.max_batch = max_batch
        dev = self.device
        self.buffers = {"ids": torch.zeros(max_batch, dtype=torch.long, device=dev),
                        "positions": torch.zeros(max_batch, dtype=torch.long, device=dev),
                        "slots": torch.zeros(max_batch, dtype=torch.long, device=dev),
                        "seq_lens": torch.ones(max_batch, dtype=torch.int32, device=dev),
                        "tables": torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=dev)}
        pin = dev.type == "cuda"
        self._staging = [{k: torch.zeros_like(v, device="cpu").pin_memory() if pin else torch.zeros_like(v,
                          device="cpu") for k, v in self.buffers.items()} for _ in range(2)]
        self._turn = 0
        self._copied: list[Any] = [None, None]  # per staging set: an event after its last H2D copy (CUDA)
        self.scratch = control.register()  # the padding rows' slot: one block of the engine's own
        self.scratch_slot = int(np.asarray(control.append([self.scratch], 1).slot_mapping)[0])
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.graph_sizes = sorted(graph_sizes or [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_batch])
        if dev.type == "cuda" and graph_sizes != []:
            self.capture()
        if prefill_graphs is None:  # default: with the decode graphs, unless KVPOOL_ENGINE_PREFILL_GRAPHS=0
            prefill_graphs = bool(self.graphs) and os.environ.get("KVPOOL_ENGINE_PREFILL_GRAPHS", "1") != "0"
        self.prefill_graphs = PrefillGraphs(self.model, blocks, self.error, self.scratch_slot,
                                            max_model_len) if prefill_graphs and self.PREFILL_GRAPHS else None

    def _paged_model(self, model: Any, helpers: str) -> Any:  # the forward (tp_engine: TPLlama's)
        return PagedLlama(model, helpers)

    # --- the two variants ---------------------------------------------------------------------------------------

    @classmethod
    def on_pool(cls, model: Any, client: Any, append_stream: bool | None = None, **kwargs: Any) -> DecodeEngine:
        """KV in the pool of ``client``'s server (attached here), control calls through ``client``'s fastest path:
        its shared-memory fast path when the server is on this host (``append_stream=None``, the default), else
        appends on one ``AppendTokenStream``; ``append_stream=True``/``False`` forces the stream / plain calls."""
        from kvpool_client.integrations.hf_llama import layout_for  # noqa: PLC0415

        pool = client.attach()
        layout = pool.layout
        expected = layout_for(model.config, layout.block_size, layout.dtype, layout.kv_layout)
        if expected != layout:
            raise ValueError(f"the server's layout {layout} does not hold this model's KV ({expected})")
        control = control_path(client, append_stream)
        return cls(model, control, torch_views.blocks(pool), live_check=lambda: pool._check_server(), pool=pool,
                   **kwargs)

    @classmethod
    def in_process(cls, model: Any, num_blocks: int, block_size: int = 16, **kwargs: Any) -> DecodeEngine:
        """The baseline: the same engine, its cache a tensor of this process, its blocks from ``LocalBlockCache``."""
        from kvpool_client.integrations.hf_llama import layout_for  # noqa: PLC0415

        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        blocks = zeros_like_pool(layout_for(model.config, block_size, dtype), num_blocks,
                                 next(model.parameters()).device)
        return cls(model, LocalBlockCache(blocks), blocks, **kwargs)

    # --- sequences ----------------------------------------------------------------------------------------------

    def add_sequence(self) -> int:
        seq = self.control.register()
        self.tables.add(seq)
        return seq

    def add_prompt(self, prompt: Sequence[int], cache_key: bytes = b"") -> tuple[int, int]:
        """A sequence for ``prompt``, registered with its token ids: it starts with the prompt's longest cached run
        (the pool's, or restored from the host tier before the reply). Returns (seq, cached tokens); ``prefill``
        it with ``prompt[cached:]`` (never empty: the last token is always computed)."""
        self.live_check()
        seq, cached = register_prompt(self.control, self.tables, prompt, cache_key, self.blocks.shape[0])
        self.prompt_tokens += len(prompt)
        self.cached_tokens += cached
        return seq, cached

    def fork(self, parent: int, num_children: int) -> list[int]:
        children = list(self.control.fork(parent, num_children)) if num_children else []
        self.tables.fork(parent, children)
        return children

    def free(self, seqs: Sequence[int]) -> None:
        if seqs:
            self.control.free(list(seqs))
            self.tables.remove(seqs)

    def _append(self, seqs: list[int], counts: np.ndarray,
                token_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Append ``counts[i]`` tokens to ``seqs[i]`` (``token_ids``: their ids, concatenated, for the prefix
        cache); the reply's slots checked (in the pool, as many as asked) and applied to the tables. Nothing is
        asked of the server that the tables cannot hold. First the last prefill's writes are waited for: this
        append seals the blocks it filled."""
        self.live_check()
        rows = self.tables.rows(seqs)
        limit = self.tables.max_blocks * self.block_size
        if np.any(self.tables.lens[rows] + counts > limit):
            raise ValueError(f"a sequence would exceed the engine's max_model_len ({limit} tokens)")
        self.fence.wait()
        one = bool(np.all(counts == 1))
        if token_ids is None:
            reply = self.control.append(seqs, 1 if one else counts.tolist())
        else:
            reply = self.prompt_control.append(seqs, 1 if one else counts.tolist(), token_ids=token_ids)
        slots = np.asarray(reply.slot_mapping, dtype=np.int64)
        if slots.size != int(counts.sum()) or (slots.size and (slots.min() < 0 or slots.max() >= self.num_slots)):
            raise ValueError(f"an Append reply names slots outside [0, {self.num_slots})")
        self.tables.apply(rows, counts, slots)
        return rows, slots

    def reserve(self, seqs: list[int], num_tokens: int) -> None:
        """Append ``num_tokens`` to each sequence without computing their KV (benchmarks: a context whose KV is
        whatever the blocks hold, read by the decode steps that follow like any other)."""
        self._append(seqs, np.full(len(seqs), num_tokens, dtype=np.int64))

    # --- prefill (eager) ----------------------------------------------------------------------------------------

    def prefill(self, seqs: list[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append each prompt to its sequence (with its token ids) and run it over the sequence's context (a
        cached run, an earlier chunk); the logits of each prompt's last token, [B, V]."""
        counts = np.array([len(p) for p in prompts], dtype=np.int64)
        flat = [t for p in prompts for t in p]
        rows, slots = self._append(seqs, counts, np.asarray(flat, dtype=np.uint32))
        lens = self.tables.lens[rows]
        positions = np.concatenate([np.arange(n - c, n) for n, c in zip(lens, counts)])
        if self.prefill_graphs is not None and len(seqs) == 1:  # a graph replay, when one serves this size
            logits = self.prefill_graphs.run(np.asarray(flat, dtype=np.int64), positions, slots,
                                             self.tables.context_slots(int(rows[0])))
            if logits is not None:
                self.fence.record(self._write_devices())
                return logits
        ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        starts = np.cumsum(counts) - counts
        spans = [(int(s), int(c), torch.from_numpy(self.tables.context_slots(int(r))).to(self.device))
                 for s, c, r in zip(starts, counts, rows)]
        attend = self.model.prefill_attend(self.blocks, self.error, spans)
        keep = torch.from_numpy(starts + counts - 1).to(self.device)
        pos, dev_slots = torch.from_numpy(positions).to(self.device), torch.from_numpy(slots).to(self.device)
        logits = self._guarded(lambda: self.model.forward(ids, pos, dev_slots, self.blocks, self.error, attend, keep))
        self.fence.record(self._write_devices())
        return logits

    def _write_devices(self) -> list[torch.device]:  # where a forward writes KV (tp_engine: every rank's device)
        return [self.device]

    # --- decode -------------------------------------------------------------------------------------------------

    def plan_decode(self, seqs: list[int]) -> DecodePlan:
        """The host half of a decode step: one token appended to each of ``seqs``, the inputs staged."""
        batch = len(seqs)
        if not 0 < batch <= self.max_batch:
            raise ValueError(f"a decode step takes 1..{self.max_batch} sequences, got {batch}")
        bucket = next((b for b in self.graph_sizes if b >= batch), batch) if self.graphs else batch
        rows, slots = self._append(seqs, np.ones(batch, dtype=np.int64))
        turn, self._turn = self._turn, self._turn ^ 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # its last copy out has run (long ago, unless nobody synchronized)
        st = self._staging[turn]
        lens = self.tables.lens[rows]
        st["slots"][:batch] = torch.from_numpy(slots)
        st["positions"][:batch] = torch.from_numpy(lens - 1)
        st["seq_lens"][:batch] = torch.from_numpy(lens.astype(np.int32))
        st["tables"][:batch] = torch.from_numpy(self.tables.table[rows])
        if bucket > batch:  # padding: the scratch slot, attended by itself
            st["slots"][batch:bucket] = self.scratch_slot
            st["positions"][batch:bucket] = 0
            st["seq_lens"][batch:bucket] = 1
            st["tables"][batch:bucket, 0] = self.scratch_slot // self.block_size
            st["ids"][batch:bucket] = 0
        return DecodePlan(seqs, bucket, turn)

    def run_decode(self, plan: DecodePlan, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The device half: each sequence's last token in, logits [B, V] out (a view of a static buffer on CUDA:
        valid until the next step). Enqueued on the current stream; nothing here waits for the device."""
        batch, bucket, st = len(plan.seqs), plan.bucket, self._staging[plan.turn]
        st["ids"][:batch] = torch.as_tensor(tokens, dtype=torch.long)
        for name, buf in self.buffers.items():
            buf[:bucket].copy_(st[name][:bucket], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[plan.turn] = torch.cuda.Event()
            self._copied[plan.turn].record()
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph[0].replay()
            return graph[1][:batch]
        return self._forward(bucket)[:batch]

    def decode(self, seqs: list[int], tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        return self.run_decode(self.plan_decode(seqs), tokens)

    def _forward(self, bucket: int) -> torch.Tensor:
        b = self.buffers
        attend = self.model.decode_attend(self.blocks, b["tables"][:bucket], b["seq_lens"][:bucket])
        return self.model.forward(b["ids"][:bucket], b["positions"][:bucket], b["slots"][:bucket], self.blocks,
                                  self.error, attend)

    def capture(self) -> None:
        """One CUDA graph per bucket, largest first, sharing one memory pool (each bucket's inputs: the scratch
        slot; a replay reads whatever the static buffers hold then)."""
        b = self.buffers
        b["slots"].fill_(self.scratch_slot)
        b["seq_lens"].fill_(1)
        b["tables"][:, 0] = self.scratch_slot // self.block_size
        pool = None
        for bucket in sorted(self.graph_sizes, reverse=True):
            self._guarded(lambda b=bucket: self._forward(b))  # compiles every kernel outside the capture
            torch.cuda.synchronize(self.device)
            try:
                graph, out = self._capture_one(bucket, pool)
            except Exception as e:  # noqa: BLE001  (a compiled helper recompiling inside the capture, say)
                if self.model.helpers == "eager":
                    raise
                warnings.warn(f"capture with the {self.model.helpers} helpers failed ({e!r:.300}); capturing "
                              "them eager", stacklevel=2)
                self.model.use_helpers("eager")
                self._forward(bucket)
                torch.cuda.synchronize(self.device)
                graph, out = self._capture_one(bucket, pool)
            pool = graph.pool() if pool is None else pool
            self.graphs[bucket] = (graph, out)
        torch.cuda.synchronize(self.device)
        self.check_errors()

    def _capture_one(self, bucket: int, pool: Any) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self._forward(bucket)
        return graph, out

    def _guarded(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``run()``; if it fails with the helpers not eager (``torch.compile`` and Triton compile at a first call),
        once more with them eager. Outside any capture only (warm-ups, prefill): a rerun rewrites the same slots."""
        try:
            return run()
        except Exception as e:  # noqa: BLE001
            if self.model.helpers == "eager":
                raise
            warnings.warn(f"the {self.model.helpers} elementwise helpers failed ({e!r:.300}); running them eagerly",
                          stacklevel=2)
            self.model.use_helpers("eager")
            return run()

    def check_errors(self) -> None:
        """Raise if a kernel was given a slot outside the pool since the last check (synchronizes)."""
        if int(self.error.item()):
            self.error.zero_()
            raise ValueError(f"a KV op was given slots outside [0, {self.num_slots}); they were skipped")

    # --- greedy generation, the control path overlapped with the device -----------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 cache_key: bytes = b"") -> list[list[int]]:
        """Greedy: each prompt registered with its token ids (``add_prompt``), only its uncached suffix
        prefilled, then ``max_new_tokens - 1`` decode steps; every sequence freed at the end (its sealed prompt
        blocks stay cached)."""
        seqs: list[int] = []
        try:
            cached = []
            for prompt in prompts:
                seq, num = self.add_prompt(prompt, cache_key)
                seqs.append(seq)
                cached.append(num)
            tokens = self.prefill(seqs, [p[c:] for p, c in zip(prompts, cached)]).argmax(-1).tolist()
            out = [[t] for t in tokens]
            plan = self.plan_decode(seqs) if max_new_tokens > 1 else None
            for step in range(1, max_new_tokens):
                assert plan is not None
                logits = self.run_decode(plan, tokens)
                plan = self.plan_decode(seqs) if step + 1 < max_new_tokens else None  # while the device runs
                tokens = logits.argmax(-1).tolist()
                for o, t in zip(out, tokens):
                    o.append(t)
            self.check_errors()
            return out
        finally:
            self.free(seqs)

    def close(self) -> None:
        """Free every sequence (the scratch one too), end the append stream, unmap the pool: the engine is done."""
        self.graphs.clear()
        self.prefill_graphs = None
        for seq in list(self.tables.row_of):
            self.free([seq])
        self.control.free([self.scratch])
        if isinstance(self.control, StreamedAppends):
            self.control.stream.close()
        if self.pool is not None:
            self.pool.close()

