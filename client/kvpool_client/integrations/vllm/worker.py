"""The connector's worker side: kvpool's pool mapped into the worker, and whole-block copies between it and vLLM's
KV cache -- every layer of a step's blocks in ``start_load_kv``, before the forward pass (the stores, then the
loads), never in the per-layer hooks, so vLLM keeps its full CUDA graphs. The copies are ``BlockCopier``'s
(``block_copy``): one Triton launch per direction on CUDA, PyTorch's indexing on the CPU backend.

The pool is mapped with the client library's ``attach()`` (shared memory on the host backend, CUDA IPC on a GPU)
through a client of the worker's own (no session: it makes no sequence). vLLM's per-layer cache is viewed as
``[num_blocks, block_size, num_kv_heads, head_size]`` for K and for V (``kv_views``: vLLM's
``[num_blocks, heads, block_size, 2 * head]``, read as the CPU backend and the CUDA backends each read it), the
pool as its logical ``[num_blocks, layers, 2, block_size, heads, head]``.

A load is refused -- its blocks reported to vLLM, which recomputes them -- when the pool is not the one the
scheduler's block ids belong to (``pool_id``: kvpool restarted), when the server process is gone (the attached
pool's check, about a microsecond) or when the copy fails. A store that fails is reported back
(``KVPoolWorkerMetadata.failed_stores``): its blocks are never sealed.
"""

from __future__ import annotations

import logging
import os
import time
from itertools import chain
from typing import Any

import numpy as np
import torch

from kvpool_client import KVPoolClient

from .block_copy import BlockCopier
from .link import LINK_ERRORS, pool_id
from .metadata import BlockCopy, KVPoolConnectorMetadata, KVPoolWorkerMetadata, pairs_of
from .settings import ConnectorSettings, LayoutMismatchError, ModelLayout

logger = logging.getLogger("kvpool_client.integrations.vllm")
# Fault injection for tests only: with this variable set to a path, a load fails while that file exists.
FAULT_FILE_ENV = "KVPOOL_VLLM_FAIL_LOADS_FILE"
WARN_EVERY_S = 60.0  # a failure that repeats every step is logged once a minute, with the count since


class RateLimitedLog:
    """One warning per ``what`` at most every WARN_EVERY_S, saying how many were left out since: the log of a
    worker whose kvpool is broken for hours stays a line a minute."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def warning(self, what: str, message: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last.get(what, -WARN_EVERY_S) < WARN_EVERY_S:
            self._left_out[what] = self._left_out.get(what, 0) + 1
            return
        left_out, self._last[what] = self._left_out.pop(what, 0), now
        suffix = f" ({left_out} more like it in the last {WARN_EVERY_S:g} s)" if left_out else ""
        logger.warning(message + suffix, *args, exc_info=exc_info)


def kv_views(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's vLLM cache tensor, each a view [num_blocks, block_size, num_kv_heads, head_size].

    vLLM 0.32 gives every backend one logical shape [blocks, heads, block_size, 2 x head] (its stride order may
    differ). The CPU backend reads a block's head as its K tokens, then its V tokens; the CUDA backends
    (FlashAttention, FlashInfer, Triton) split the last dimension: K is [..., :head], V is [..., head:]."""
    shape = tuple(cache.shape)
    if cache.dim() == 4 and shape[2] == block_size and shape[3] % 2 == 0:
        n, h, b, d2 = shape
        if cache.device.type == "cpu":
            kv = cache.view(n, h, 2, b, d2 // 2)
            return kv[:, :, 0].permute(0, 2, 1, 3), kv[:, :, 1].permute(0, 2, 1, 3)
        d = d2 // 2
        return cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2)
    raise ValueError(f"KVPoolConnector: a vLLM KV cache tensor of shape {shape} (block size {block_size}) is in a "
                     "layout it does not know ([blocks, heads, block_size, 2 x head])")


class KVPoolWorker:
    def __init__(self, settings: ConnectorSettings, layout: ModelLayout) -> None:
        self.settings = settings
        self.layout = layout
        self._token = settings.token()
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copier: BlockCopier | None = None
        self._client: KVPoolClient | None = None
        self._pool: Any = None
        self._pool_tensor: torch.Tensor | None = None
        self._pool_id = ""
        self._load_errors: set[int] = set()
        self._finished_stores: set[str] = set()
        self._failed_stores: set[str] = set()
        self.blocks_loaded = 0
        self.blocks_stored = 0
        self._log = RateLimitedLog()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self._layers = [kv_views(kv_caches[name], self.layout.block_size) for name in names]
        k = self._layers[0][0] if self._layers else None
        got = ModelLayout(len(names), int(k.shape[2]), int(k.shape[3]), int(k.shape[1]),
                          str(k.dtype).removeprefix("torch.")) if k is not None else None
        if got != self.layout:
            raise LayoutMismatchError(f"KVPoolConnector: vLLM's KV cache tensors hold {got and got.describe()}, "
                                      f"its KV cache spec says {self.layout.describe()}")
        self._copier = BlockCopier(self._layers)

    @property
    def copy_path(self) -> str:
        """The path the last copy took: "triton" or "torch (<why not the kernel>)" ("" before any)."""
        return self._copier.path if self._copier is not None else ""

    # ------------------------------------------------------------------ the pool
    def _attach(self, wanted: str) -> bool:
        """Map the pool ``wanted`` names (the scheduler's); False when that pool is not reachable from here."""
        if wanted and wanted == self._pool_id and self._pool is not None:
            return True
        self._detach()
        if not wanted:
            return False
        try:
            self._client = KVPoolClient(self.settings.target, timeout=self.settings.timeout_s, session=False,
                                        token=self._token)
            pool = self._client.attach()
        except LINK_ERRORS as error:
            self._log.warning("map", "KVPoolConnector: cannot map kvpool's pool (%s: %s); loads are recomputed",
                              type(error).__name__, error)
            self._detach()
            return False
        self._pool, self._pool_id = pool, pool_id(pool.description)
        blocks = pool.blocks
        tensor = torch.from_numpy(blocks) if pool.backend == "host" else torch.as_tensor(blocks, device="cuda")
        if self.layout.dtype == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        self._pool_tensor = tensor
        return self._pool_id == wanted

    def _detach(self) -> None:
        client, self._client, self._pool, self._pool_tensor, self._pool_id = self._client, None, None, None, ""
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001  (best-effort: the server may be gone)
                logger.debug("closing the worker's kvpool client failed", exc_info=True)

    def _usable(self, meta: KVPoolConnectorMetadata) -> bool:
        if not self._attach(meta.pool_id):
            return False
        try:
            self._pool.check_live("read")
        except LINK_ERRORS:
            self._detach()
            return False
        return True

    # ------------------------------------------------------------------ the copies
    def start_load_kv(self, meta: KVPoolConnectorMetadata | None) -> None:
        """Before the forward pass: the step's stores, then its loads. The stores copy KV an earlier step
        computed (the scheduler appends a step's prompt blocks in the next step's one kvpool call), so they go
        first: vLLM may have given a preempted request's block to a request whose load, or this step's forward
        pass, writes it -- and nothing else writes vLLM's KV between two forward passes. Each direction's copy is
        launched first, from the step's id arrays (``load_pairs``, ``store_pairs``: the scheduler's), the
        bookkeeping after it."""
        if meta is None:
            return
        if meta.stores or meta.saves:
            self._store(meta)
        if not meta.loads:
            return
        try:
            pairs = meta.load_pairs if meta.load_pairs is not None else pairs_of(meta.loads)
            if not pairs.shape[1]:
                return
            if not self._usable(meta):
                self._failed(meta.loads)
                return
            self._copy(pairs, into_vllm=True)
        except Exception:  # noqa: BLE001  (any failure of a copy is a recompute, never a wrong token)
            self._log.warning("load", "KVPoolConnector: a load from kvpool failed; vLLM recomputes it", exc_info=True)
            self._failed(meta.loads)
            return
        self.blocks_loaded += pairs.shape[1]

    def _failed(self, loads: list[BlockCopy]) -> None:
        for load in loads:
            self._load_errors.update(load.vllm_blocks)

    def _store(self, meta: KVPoolConnectorMetadata) -> None:
        """The step's stores (finished requests: each answered in ``finished_sending``) and saves (running
        requests' prompt blocks, computed by an earlier step's forward pass), in one copy."""
        try:
            pairs = meta.store_pairs if meta.store_pairs is not None else pairs_of([*meta.stores, *meta.saves])
            if pairs.shape[1]:
                if not self._usable(meta):
                    raise ConnectionError("kvpool's pool is not the scheduler's or its server is gone")
                self._copy(pairs, into_vllm=False)
                if self._pool_tensor is not None and self._pool_tensor.is_cuda:
                    torch.cuda.current_stream().synchronize()  # in the pool before finished_sending lets it seal
        except Exception as error:  # noqa: BLE001  (a store that fails is a later miss: never sealed)
            self._log.warning("store", "KVPoolConnector: a store into kvpool failed (%s: %s)", type(error).__name__,
                              error)
            self._failed_stores.update(s.req_id for s in chain(meta.stores, meta.saves) if s.pool_blocks)
            self._finished_stores.update(store.req_id for store in meta.stores)
            return
        self._finished_stores.update(store.req_id for store in meta.stores)
        self.blocks_stored += pairs.shape[1]

    def _copy(self, pairs: np.ndarray, *, into_vllm: bool) -> None:
        assert self._pool_tensor is not None and self._copier is not None
        if into_vllm:
            fault = os.environ.get(FAULT_FILE_ENV)
            if fault and os.path.exists(fault):
                raise RuntimeError(f"a load failure injected by the test ({FAULT_FILE_ENV})")
        self._copier.copy_pairs(self._pool_tensor, pairs, into_vllm=into_vllm)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        done, self._finished_stores = self._finished_stores, set()
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def worker_meta(self) -> KVPoolWorkerMetadata | None:
        if not self._failed_stores:
            return None
        failed, self._failed_stores = self._failed_stores, set()
        return KVPoolWorkerMetadata(failed)

    def close(self) -> None:
        self._detach()
