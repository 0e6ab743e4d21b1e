"""The scheduler side's one kvpool call a step (``StepCall._call``, a part of ``KVPoolScheduler``): what is
waiting -- frees, stores, seals -- and the step's lookups, as one ``KVPoolClient.step``, and its answer applied to
the requests' states (scheduler.py's docstring says when it is made and what each part does)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool_client import InvalidArgumentError, PermissionDeniedError, ResourceExhaustedError

from .link import KVPoolLink
from .metadata import BlockCopy
from .requests import RequestState, Store

# A request's own failures (its prompt too long for the server, the tenant's quota or the pool full): a miss for it.
REQUEST_ERRORS = (InvalidArgumentError, ResourceExhaustedError, PermissionDeniedError)


class StepCall:
    """``KVPoolScheduler``'s call: the scheduler's state it reads and writes, declared here."""

    link: KVPoolLink
    block_size: int
    round_trips: int
    registers: int
    _step: int
    _called_step: int
    _requests: dict[str, RequestState]
    _stores: list[Store]
    _saves: list[Store]
    _copies: list[BlockCopy]
    _sent: dict[str, tuple[RequestState, int]]
    _saving: dict[str, RequestState]
    _to_seal: list[tuple[RequestState, int]]
    _to_free: list[RequestState]

    def _live(self, state: RequestState) -> bool:
        raise NotImplementedError

    def _prompt_seals(self, appending: set[str]) -> list[RequestState]:
        raise NotImplementedError

    def _call(self, prompts: list[list[int]] | None = None, keys: list[bytes] | None = None) -> list[RequestState]:
        """The step's one kvpool call (``KVPoolClient.step``): the frees waiting; one append of the stores
        waiting (the last step's prompt saves, finished requests') and the seals due; one register of ``prompts``
        (the step's lookups) and of the finished requests kvpool has no sequence of (appended by the next call).
        Returns a state per prompt (a miss each where the register failed); the append's copies go into this
        step's metadata (``_copies``)."""
        self._called_step = self._step
        prompts, keys = list(prompts or []), list(keys or [])
        n_lookups = len(prompts)
        frees = [state for state in self._to_free if self._live(state)]
        stores = self._stores + [s for s in self._saves if self._requests.get(s.req_id) is s.state]
        seals = self._to_seal
        self._to_free, self._stores, self._saves, self._to_seal = [], [], [], []
        unregistered = [s for s in stores if s.state.seq_id is None and not s.running]
        prompts += [s.tokens + [s.seal_token] for s in unregistered]
        keys += [s.key for s in unregistered]
        appending = [s for s in stores if self._live(s.state) and not s.state.poisoned
                     and len(s.tokens) > s.state.kv_tokens]
        taken = {id(s) for s in appending + unregistered}
        done = [s.state for s in stores if not s.running and id(s) not in taken]  # nothing to store: freed
        done += [state for state, _ in seals if state.poisoned]
        seals = [(state, token) for state, token in seals if self._live(state) and not state.poisoned]
        running_seals = self._prompt_seals({s.req_id for s in appending})
        seals += [(state, state.token(state.seq_tokens)) for state in running_seals]
        copies = {s.req_id: BlockCopy(s.req_id, (), ()) for s in stores if not s.running and id(s) not in taken}
        append = None
        if appending or seals:
            append = ([s.state.seq_id for s in appending] + [state.seq_id for state, _ in seals],
                      [len(s.tokens) - s.state.seq_tokens for s in appending] + [1] * len(seals),
                      [t for s in appending for t in s.tokens[s.state.seq_tokens:]] + [t for _, t in seals])
        free_ids = [state.seq_id for state in frees]
        if not (free_ids or append or prompts):
            self._to_free = done
            self._copies += list(copies.values())
            return []
        if self.link.client is not None:
            self.round_trips += 1
            self.registers += bool(prompts)
        result = self.link.call("Step", lambda c: c.step(free=free_ids, append=append,
                                                         register=(prompts, keys) if prompts else None),
                                per_request=REQUEST_ERRORS)
        appended = self._part(result, "appended", "AppendToken")
        registered = self._part(result, "registered", "RegisterSequences")
        self._part(result, "freed", "Free")  # a Free refused: its sequences end with the session
        running = {id(state) for state in running_seals}
        done += [state for state, _ in seals if id(state) not in running]  # sealed now, or never: done
        if append is not None and appended is None:
            done += [s.state for s in appending if not s.running]
            for state in [s.state for s in appending] + running_seals:
                state.poisoned = True  # what it appended (if anything) is never sealed
        elif appended is not None:
            for state in running_seals:
                state.seq_tokens, state.unsealed = state.seq_tokens + 1, False
            for store in appending:
                copies[store.req_id] = self._copy(store, appended.slots_of(store.state.seq_id))
        found = self._states(registered, prompts, keys)
        for store, state in zip(unregistered, found[n_lookups:]):
            store.state = state
            if self._live(state):
                self._stores.append(store)  # appended by the next call; vLLM keeps its blocks meanwhile
            else:
                copies[store.req_id] = BlockCopy(store.req_id, (), ())  # not stored: answered now
        self._to_free += done
        self._copies += list(copies.values())
        return found[:n_lookups]

    def _part(self, result: Any, part: str, what: str) -> Any:
        """A part of the step's answer; None when it failed (a request's own error: a miss; any other takes the
        link down, as a failed call does)."""
        if result is None:
            return None
        answer = getattr(result, part)
        if isinstance(answer, Exception):
            if not isinstance(answer, REQUEST_ERRORS):
                self.link.down(f"{what} failed ({type(answer).__name__}: {answer})")
            return None
        return answer

    def _states(self, registered: Any, prompts: list[list[int]], keys: list[bytes]) -> list[RequestState]:
        """A state per registered prompt (a miss each when the register failed)."""
        if registered is None:
            return [RequestState() for _ in prompts]
        generation, size = self.link.generation, self.block_size
        return [RequestState(r.seq_id, generation, kv_tokens=r.num_cached_tokens, seq_tokens=r.num_cached_tokens,
                             key=key, pool_blocks=[int(b) for b in r.cached_block_ids[: r.num_cached_tokens // size]])
                for r, key in zip(registered, keys)]

    def _copy(self, store: Store, slots: Any) -> BlockCopy:
        """The workers' copy for an append of ``store``'s tokens that kvpool answered with ``slots``."""
        state, size = store.state, self.block_size
        blocks = np.asarray(slots, dtype=np.int64) // size  # the block of a sealing token first, then whole blocks
        pool_blocks: list[int] = blocks[np.r_[True, blocks[1:] != blocks[:-1]]].tolist() if blocks.size else []
        copy = BlockCopy(store.req_id, tuple(pool_blocks), tuple(store.vllm_blocks[state.kv_tokens // size:]))
        if store.running:
            state.pool_blocks += pool_blocks
            state.kv_tokens = state.seq_tokens = len(store.tokens)
            state.unsealed, state.saved_step = True, self._step
            self._saving[store.req_id] = state
        else:
            self._sent[store.req_id] = (state, store.seal_token)
        return copy

