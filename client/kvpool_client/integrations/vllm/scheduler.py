"""The connector's scheduler side: look a prompt up in kvpool, pin what it holds, load it, store what vLLM computed.

Each request that may be cached gets one kvpool sequence, registered with its prompt when vLLM first asks how many
tokens kvpool can give (``RegisterSequence`` with ``prompt_token_ids``: kvpool answers the run of full blocks it has
cached, and the sequence pins them -- nothing can evict them until it is freed). The answer is kept, so vLLM may ask
again and gets the same answer with no second call: as far as vLLM can tell the lookup has no side effect. The
blocks beyond vLLM's own hit are the external tokens; once vLLM has allocated blocks for them, the step's metadata
tells the workers to copy those pool blocks into vLLM's blocks before the forward pass.

When the request finishes, its full blocks that kvpool does not hold yet are appended to the same sequence (with
their token ids, so kvpool hashes them), and vLLM keeps the request's blocks (``request_finished`` -> True) until a
worker has copied them into the pool after the step's forward pass and said so (``finished_sending``). The next
append of the sequence -- one token past the blocks -- seals them (docs/prefix-caching.md: a block becomes matchable
with its sequence's next append, which is why the store is confirmed first), and the sequence is freed: the blocks
stay cached, evictable, for any frontend of the tenant.

Round trips to kvpool, all from the scheduler's thread (over the shared-memory fast path when kvpool is local): one
``RegisterSequence`` per new request (plus a ``GetBlockTable`` when it hits), and per step at most one ``AppendToken``
(every store and seal of the step together) and one ``Free`` (every sequence done with). A step that only decodes
makes none. ``round_trips`` counts them (the benchmark and the tests read it).

Failure is a miss: an unreachable or dead kvpool (``KVPoolLink``) answers 0 tokens, stores nothing, and a request's
kvpool state from an older connection is dropped. A load whose blocks a worker could not copy is reported to vLLM
by that worker (``get_block_ids_with_load_errors``) and recomputed. A store a worker could not make is never sealed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvpool_client import InvalidArgumentError, PermissionDeniedError, ResourceExhaustedError

from .link import KVPoolLink
from .metadata import BlockCopy, KVPoolConnectorMetadata, KVPoolWorkerMetadata
from .settings import MAX_CACHE_KEY_BYTES

logger = logging.getLogger("kvpool_client.integrations.vllm")

# A request's own failures (its prompt too long for the server, the tenant's quota or the pool full): a miss for it.
REQUEST_ERRORS = (InvalidArgumentError, ResourceExhaustedError, PermissionDeniedError)


@dataclass
class RequestState:
    """What kvpool holds for one request: ``seq_id`` (None: nothing) of connection ``generation``, whose first
    ``kv_tokens`` tokens have KV in the pool blocks ``pool_blocks``."""

    seq_id: int | None = None
    generation: int = 0
    kv_tokens: int = 0
    pool_blocks: list[int] = field(default_factory=list)
    local_tokens: int = 0  # vLLM's own hit, as last given to get_num_new_matched_tokens


@dataclass
class Store:
    """A finished request's full blocks to put into kvpool: ``tokens`` (all of them, from 0) in ``vllm_blocks``."""

    req_id: str
    state: RequestState
    tokens: list[int]
    seal_token: int
    vllm_blocks: list[int]
    key: bytes


class KVPoolScheduler:
    def __init__(self, link: KVPoolLink, block_size: int) -> None:
        self.link = link
        self.block_size = block_size
        self._requests: dict[str, RequestState] = {}
        self._loads: list[BlockCopy] = []
        self._stores: list[Store] = []
        self._sent: dict[str, tuple[RequestState, int]] = {}  # stores the workers copy now: (state, seal token)
        self._to_seal: list[tuple[RequestState, int]] = []
        self._to_free: list[RequestState] = []
        self.round_trips = 0

    # ------------------------------------------------------------------ lookups and loads
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = self._lookup(request)
        state.local_tokens = num_computed_tokens
        if not self._live(state):
            return 0, False
        return max(0, state.kv_tokens - num_computed_tokens), False

    def _lookup(self, request: Any) -> RequestState:
        key = cache_key(request, self.link.settings.cache_key)
        prompt = list(request.prompt_token_ids or ())
        if key is None or len(prompt) <= self.block_size or self.link.client is None:
            return RequestState()
        self.round_trips += 1
        found = self.link.call("RegisterSequence", lambda c: c.register_prompt(prompt, cache_extra_key=key),
                               per_request=REQUEST_ERRORS)
        if found is None:
            return RequestState()
        seq_id, cached = found  # type: ignore[misc]
        state = RequestState(seq_id, self.link.generation)
        if cached:
            self.round_trips += 1
            table = self.link.call("GetBlockTable", lambda c: c.block_table(seq_id))
            if table is not None:
                state.kv_tokens = cached
                state.pool_blocks = [int(b) for b in table.block_ids[: cached // self.block_size]]  # type: ignore[attr-defined]
        return state

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if num_external_tokens <= 0 or state is None:
            return
        vllm_blocks = blocks.get_block_ids()[0]
        first = state.local_tokens // self.block_size
        end = -(-(state.local_tokens + num_external_tokens) // self.block_size)
        self._loads.append(BlockCopy(request.request_id, tuple(state.pool_blocks[first:end]),
                                     tuple(vllm_blocks[first:end])))

    # ------------------------------------------------------------------ stores
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None) or RequestState()
        if not self._live(state):
            state = RequestState()
        tokens = list(request.all_token_ids)
        full = min(len(block_ids), request.num_computed_tokens // self.block_size)
        key = cache_key(request, self.link.settings.cache_key)
        if key is None or self.link.client is None or full * self.block_size <= state.kv_tokens:
            self._release(state)
            return False, None
        end = full * self.block_size
        seal = tokens[end] if len(tokens) > end else 0
        self._stores.append(Store(request.request_id, state, tokens[:end], seal, list(block_ids[:full]), key))
        return True, None  # vLLM keeps the blocks until a worker copied them (finished_sending)

    def update_connector_output(self, output: Any) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        failed = meta.failed_stores if isinstance(meta, KVPoolWorkerMetadata) else set()
        for req_id in output.finished_sending or ():
            sent = self._sent.pop(req_id, None)
            if sent is None:
                continue
            if req_id in failed or not self._live(sent[0]):
                self._release(sent[0])  # its new blocks hold no KV: freed unsealed, never matchable
            else:
                self._to_seal.append(sent)

    def has_pending_work(self) -> bool:
        """Seals and frees not made yet: vLLM keeps stepping until they are (then the blocks are matchable)."""
        return self.link.client is not None and bool(self._to_seal or self._to_free)

    # ------------------------------------------------------------------ the step
    def build_connector_meta(self) -> KVPoolConnectorMetadata:
        meta = KVPoolConnectorMetadata(pool_id=self.link.pool_id, loads=self._loads)
        self._loads = []
        stores, self._stores = self._stores, []
        if stores or self._to_seal or self._to_free:
            meta.stores = self._flush(stores)
        return meta

    def _flush(self, stores: list[Store]) -> list[BlockCopy]:
        """The step's kvpool calls: registers for stores that have no sequence, one append (stores and seals), one
        free. Returns the stores for the workers (with no blocks where kvpool took none: still answered)."""
        seals, frees = self._to_seal, self._to_free
        self._to_seal, self._to_free = [], []
        for store in stores:
            if store.state.seq_id is None:
                store.state = self._register(store)
        appending = [s for s in stores if self._live(s.state) and len(s.tokens) > s.state.kv_tokens]
        frees += [s.state for s in stores if s not in appending]
        seals = [(state, token) for state, token in seals if self._live(state)]
        copies = {s.req_id: BlockCopy(s.req_id, (), ()) for s in stores}
        if appending or seals:
            ids = [s.state.seq_id for s in appending] + [state.seq_id for state, _ in seals]
            counts = [len(s.tokens) - s.state.kv_tokens for s in appending] + [1] * len(seals)
            token_ids = [t for s in appending for t in s.tokens[s.state.kv_tokens:]] + [t for _, t in seals]
            self.round_trips += 1
            result = self.link.call("AppendToken", lambda c: c.append(ids, counts, token_ids=token_ids),
                                    per_request=REQUEST_ERRORS)
            frees += [state for state, _ in seals]  # sealed now (or not at all): done with either way
            if result is None:
                frees += [s.state for s in appending]
            else:
                for store in appending:
                    slots = result.slots_of(store.state.seq_id)  # type: ignore[attr-defined]
                    first = store.state.kv_tokens // self.block_size
                    copies[store.req_id] = BlockCopy(store.req_id, tuple(int(x) // self.block_size
                                                                         for x in slots[:: self.block_size]),
                                                     tuple(store.vllm_blocks[first:]))
                    self._sent[store.req_id] = (store.state, store.seal_token)
        self._free(frees)
        return list(copies.values())

    def _register(self, store: Store) -> RequestState:
        self.round_trips += 1
        prompt, key = store.tokens + [store.seal_token], store.key
        found = self.link.call("RegisterSequence", lambda c: c.register_prompt(prompt, cache_extra_key=key),
                               per_request=REQUEST_ERRORS)
        if found is None:
            return RequestState()
        seq_id, cached = found  # type: ignore[misc]
        return RequestState(seq_id, self.link.generation, kv_tokens=cached)

    def _release(self, state: RequestState) -> None:
        if self._live(state):
            self._to_free.append(state)

    def _free(self, states: list[RequestState]) -> None:
        ids = [s.seq_id for s in states if self._live(s)]
        if ids:
            self.round_trips += 1
            self.link.call("Free", lambda c: c.free(ids), per_request=REQUEST_ERRORS)

    def _live(self, state: RequestState) -> bool:
        """The state's sequence exists on the connection in use (a reconnect ended the old session's)."""
        return state.seq_id is not None and state.generation == self.link.generation and \
            self.link.client is not None


def cache_key(request: Any, namespace: str) -> bytes | None:
    """The ``cache_extra_key`` of a request (its LoRA adapter and cache salt, and the connector's namespace), or
    None for a request kvpool cannot cache: prompt embeddings, multimodal inputs, a key over kvpool's bound."""
    if getattr(request, "prompt_embeds", None) is not None or getattr(request, "mm_features", None):
        return None
    lora = getattr(request, "lora_request", None)
    return cache_key_bytes(namespace, getattr(lora, "lora_name", None), getattr(request, "cache_salt", None))


def cache_key_bytes(namespace: str, lora: str | None, salt: str | None) -> bytes | None:
    if not (namespace or lora or salt):
        return b""
    key = f"vllm:{namespace}\x00lora:{lora or ''}\x00salt:{salt or ''}".encode()
    return key if len(key) <= MAX_CACHE_KEY_BYTES else None
