"""The connector's scheduler side: look a prompt up in kvpool, pin what it holds, load it, store what vLLM computed.

Lookups. Each request that may be cached gets one kvpool sequence, registered with its prompt (kvpool answers the
run of full blocks it has cached, and the sequence pins them -- nothing evicts them until it is freed). vLLM asks
per request, inside its ``schedule()``; the first time it asks in a step, that request and every other request
vLLM queued since (``on_new_request``) that is not looked up yet -- at most ``max_lookups`` requests (vLLM's
``max_num_seqs``) and ``LOOKUP_TOKENS`` prompt tokens -- are registered in one ``RegisterSequences`` call, whose
reply carries each sequence's cached block ids. A request vLLM asks about later in the same step that is in no
lookup yet (it came past the bounds) is answered None, "ask again": vLLM skips it this step and it is looked up
first in the next. The answers are kept, so vLLM may ask again and gets the same answer with no second call: as
far as vLLM can tell the lookup has no side effect. The blocks beyond vLLM's own hit are the external tokens;
once vLLM has allocated blocks for them, the step's metadata tells the workers to copy those pool blocks into
vLLM's blocks before the forward pass.

Stores. The prompt blocks a step computes (its prefill, or each chunk of it) are appended to the request's
sequence (with their token ids, so kvpool hashes them) by the next step's call, and the workers copy them into the
pool at the start of that step, before its loads (``saves``): the blocks still hold what the prefill computed
(nothing writes vLLM's KV between two forward passes), even a preempted request's that vLLM gave to a request
whose load writes it in that step. When a request finishes, its other full blocks are appended likewise, and vLLM
keeps the request's blocks (``request_finished`` -> True) until a worker has copied them and said so
(``finished_sending``). A block becomes matchable with its sequence's next append (docs/prefix-caching.md), made
only once the copies are done: for a finished request one token more, then (the next call) the sequence is freed
-- its blocks stay cached, evictable, for any frontend of the tenant; for a running request's prompt, one token
more (its next token) in the next step that calls kvpool anyway, and at the latest ``SEAL_WITHIN_STEPS`` steps
after its store. Prompt stores need vLLM's synchronous scheduling (a step's copies are done, and their failures
reported, before the next step is built; the CPU backend always has it); with asynchronous scheduling only
finished requests are stored.

Round trips: one at most a step, whatever the number of requests -- ``KVPoolClient.step``, one step record over
the fast path when kvpool is local: the frees waiting, one append (the stores waiting and the seals due), one
register (the step's lookups, and finished requests that have no sequence yet: their lookup missed, a short
prompt, kvpool away; their append goes in the next call). The step's first call to kvpool makes it: the lookup
in ``schedule()`` when the step looks anything up, else ``build_connector_meta`` when work is waiting. A step that
only decodes makes none, but for the forced seal. ``round_trips`` counts them, and ``registers`` those with a
register (the benchmark and the tests read them).

Failure is a miss: an unreachable or dead kvpool (``KVPoolLink``) answers 0 tokens and stores nothing, and state of
an older connection is dropped. A load whose blocks a worker could not copy is reported to vLLM by that worker and
recomputed; a store a worker could not make (``KVPoolWorkerMetadata``) poisons its sequence: never sealed.
"""

from __future__ import annotations

import itertools
from typing import Any

from .link import KVPoolLink
from .metadata import BlockCopy, KVPoolConnectorMetadata, KVPoolWorkerMetadata
from .requests import RequestState, Store, cache_key
from .step_call import StepCall

SEAL_WITHIN_STEPS = 16
MAX_LOOKUPS = 256  # requests in one lookup, at most (and at most the server's --max-batch, 4,096 by default)
LOOKUP_TOKENS = 32768  # prompt tokens in one lookup, at most (a longer prompt goes alone; --max-tokens-per-call)


class KVPoolScheduler(StepCall):
    def __init__(self, link: KVPoolLink, block_size: int, blocks_of: Any = None, max_lookups: int = 256) -> None:
        """``blocks_of(req_id)``: vLLM's block ids of a running request, for prompt stores (None: they are off).
        ``max_lookups``: the most requests one lookup takes (vLLM's ``max_num_seqs``: the most a step admits)."""
        self.link = link
        self.block_size = block_size
        self.max_lookups = max(1, min(max_lookups, MAX_LOOKUPS))
        self._blocks_of = blocks_of
        self._requests: dict[str, RequestState] = {}
        self._unlooked: dict[str, Any] = {}  # vLLM's queued requests not looked up yet (on_new_request)
        self._lookup_step = -1  # the step whose lookup was made
        self._loads: list[BlockCopy] = []
        self._stores: list[Store] = []  # finished requests' stores, for the next step
        self._saves: list[Store] = []  # the last step's prompt stores, for this step's call
        self._copies: list[BlockCopy] = []  # this step's call's stores, for its workers (before their loads)
        self._sent: dict[str, tuple[RequestState, int]] = {}  # finished stores the workers copy: (state, seal)
        self._saving: dict[str, RequestState] = {}  # prompt stores sent, until the step's output said how they went
        self._to_seal: list[tuple[RequestState, int]] = []  # finished requests' blocks to seal, then free
        self._to_free: list[RequestState] = []
        self._step = 0  # the step being scheduled (one more once its metadata is built)
        self._called_step = -1  # the step whose kvpool call was made
        self.round_trips = 0
        self.registers = 0  # of them with a register (the step's lookups, finished requests with no sequence)

    # ------------------------------------------------------------------ lookups and loads
    def on_new_request(self, request: Any) -> None:
        """vLLM queued ``request``: looked up with the step's other new requests when vLLM first asks for one."""
        self._unlooked[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            if self._cacheable(request) is None:
                self._unlooked.pop(request.request_id, None)
                state = self._requests[request.request_id] = RequestState()  # a miss, without asking kvpool
            elif self._lookup_step == self._step:
                self._unlooked[request.request_id] = request
                return None, False  # this step's one lookup is made: vLLM asks again next step
            else:
                self._lookup(request)
                state = self._requests[request.request_id]
        state.local_tokens = num_computed_tokens
        if not self._live(state) or state.poisoned:
            return 0, False
        return max(0, state.kv_tokens - num_computed_tokens), False

    def _cacheable(self, request: Any) -> bytes | None:
        """The request's ``cache_extra_key`` when kvpool may hold its prompt (and is reachable), else None."""
        if self.link.client is None or len(request.prompt_token_ids or ()) <= self.block_size:
            return None
        return cache_key(request, self.link.settings.cache_key)

    def _lookup(self, request: Any) -> None:
        """Look ``request`` up, and with it the other requests vLLM queued that are not looked up yet (at most
        ``max_lookups`` requests and ``LOOKUP_TOKENS`` prompt tokens in all, ``request`` first): one
        RegisterSequences, whose reply carries the cached blocks."""
        self._unlooked.pop(request.request_id, None)
        batch, keys, tokens = [request], [self._cacheable(request) or b""], len(request.prompt_token_ids)
        for other in list(itertools.islice(self._unlooked.values(), self.max_lookups - 1)):  # in vLLM's order
            key = self._cacheable(other)
            if key is not None and tokens + len(other.prompt_token_ids) > LOOKUP_TOKENS:
                break  # it and those after it: the next step's
            del self._unlooked[other.request_id]
            if key is None:
                self._requests[other.request_id] = RequestState()
                continue
            batch.append(other)
            keys.append(key)
            tokens += len(other.prompt_token_ids)
        self._lookup_step = self._step
        found = self._register_many([list(r.prompt_token_ids) for r in batch], keys)
        for other, state in zip(batch, found):
            if state.seq_id is not None and self._blocks_of is not None:
                state.request = other
            self._requests[other.request_id] = state

    def _register_many(self, prompts: list[list[int]], keys: list[bytes]) -> list[RequestState]:
        """The step's call with the lookups of ``prompts``: a state each (a miss each when it failed)."""
        return self._call(prompts, keys)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if num_external_tokens <= 0 or state is None:
            return
        vllm_blocks = blocks.get_block_ids()[0]
        first = state.local_tokens // self.block_size
        end = -(-(state.local_tokens + num_external_tokens) // self.block_size)
        self._loads.append(BlockCopy(request.request_id, tuple(state.pool_blocks[first:end]),
                                     tuple(vllm_blocks[first:end])))

    # ------------------------------------------------------------------ finished requests
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._unlooked.pop(request.request_id, None)
        state = self._requests.pop(request.request_id, None) or RequestState()
        if not self._live(state):
            state = RequestState()
        tokens = list(request.all_token_ids)
        full = min(len(block_ids), request.num_computed_tokens // self.block_size)
        key = cache_key(request, self.link.settings.cache_key)
        end = full * self.block_size
        if key is None or self.link.client is None or state.poisoned or end <= state.kv_tokens:
            if state.unsealed and not state.poisoned and len(tokens) > state.seq_tokens:
                self._to_seal.append((state, tokens[state.seq_tokens]))  # its prompt blocks: in the pool already
            else:
                self._release(state)
            return False, None
        seal = tokens[end] if len(tokens) > end else 0
        self._stores.append(Store(request.request_id, state, tokens[:end], seal, list(block_ids[:full]), key, False))
        return True, None  # vLLM keeps the blocks until a worker copied them (finished_sending)

    def update_connector_output(self, output: Any) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        failed = meta.failed_stores if isinstance(meta, KVPoolWorkerMetadata) else set()
        for req_id in failed:
            if req_id in self._saving:
                self._saving[req_id].poisoned = True
        self._saving.clear()
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
        return bool(self._stores) or self.link.client is not None and bool(self._to_seal or self._to_free)

    # ------------------------------------------------------------------ the step
    def build_connector_meta(self, scheduler_output: Any) -> KVPoolConnectorMetadata:
        meta = KVPoolConnectorMetadata(pool_id=self.link.pool_id, loads=self._loads)
        self._loads = []
        if self._called_step != self._step and self._pending():
            self._call()  # no lookup this step: the step's one call here
        copies, self._copies = self._copies, []
        meta.stores = [c for c in copies if c.req_id not in self._requests]  # finished: answered
        meta.saves = [c for c in copies if c.req_id in self._requests]  # running: prompt stores
        if meta.stores or meta.saves:
            scheduler_output.has_sync_kv_loads = True  # start_load_kv before the forward pass: stores, then loads
        # This step's prompt blocks: appended by the next step's call, copied before its loads.
        self._saves = self._prompt_saves(scheduler_output) if self._blocks_of is not None else []
        self._step += 1
        return meta.with_pairs()

    def _pending(self) -> bool:
        """Work for a call: stores, saves, seals and frees waiting, or a prompt seal due (SEAL_WITHIN_STEPS)."""
        if self.link.client is None:  # the finished requests' stores are still answered (nothing stored)
            self._saves, self._to_seal, self._to_free = [], [], []
            return bool(self._stores)
        return bool(self._stores or self._saves or self._to_seal or self._to_free) or any(
            self._step - state.saved_step >= SEAL_WITHIN_STEPS for state in self._prompt_seals(set()))

    def _prompt_saves(self, scheduler_output: Any) -> list[Store]:
        """The prompt blocks this step computes that kvpool does not hold: stored after its forward pass."""
        saves, before = [], None
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or state.request is None or not self._live(state) or state.poisoned:
                continue
            prompt_len = len(state.request.prompt_token_ids)
            if state.kv_tokens >= prompt_len - prompt_len % self.block_size:
                continue  # the common case: every full block of the prompt is in kvpool already
            before = before if before is not None else self._computed_before(scheduler_output)
            computed = before[req_id] + scheduled
            full = min(computed, prompt_len) // self.block_size
            if full * self.block_size > state.kv_tokens:
                saves.append(Store(req_id, state, list(state.request.prompt_token_ids[: full * self.block_size]), 0,
                                   list(self._blocks_of(req_id)[:full]), state.key, True))
        return saves

    @staticmethod
    def _computed_before(scheduler_output: Any) -> dict[str, int]:
        """Each scheduled request's tokens computed before this step."""
        cached = scheduler_output.scheduled_cached_reqs
        before = dict(zip(cached.req_ids, map(int, cached.num_computed_tokens)))
        before.update((new.req_id, int(new.num_computed_tokens)) for new in scheduler_output.scheduled_new_reqs)
        return before

    def _prompt_seals(self, appending: set[str]) -> list[RequestState]:
        """Running requests whose stored prompt blocks were copied in an earlier step and await their seal (an
        append made for them this step seals them anyway)."""
        return [state for req_id, state in self._requests.items()
                if state.unsealed and not state.poisoned and state.saved_step < self._step and req_id not in appending
                and self._live(state) and state.num_tokens() > state.seq_tokens]

    def _release(self, state: RequestState) -> None:
        if self._live(state):
            self._to_free.append(state)

    def _live(self, state: RequestState) -> bool:
        """The state's sequence exists on the connection in use (a reconnect ended the old session's)."""
        return state.seq_id is not None and state.generation == self.link.generation and \
            self.link.client is not None
