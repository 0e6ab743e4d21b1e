"""What every part of a load-generator process works on: its state, and the plumbing of its calls.

``Worker`` (worker.py) is this state plus three parts, each a class of its own module that inherits this one:
``Admission`` (admission.py: admitting, deferring, preempting), ``PrefixRequests`` (prefix_requests.py: the
prefix-caching workloads' requests) and the loop itself (worker.py). None of those modules imports another's: a
part calls another's method through ``self``, and the methods one part needs of another are declared here.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any

import numpy as np

from kvpool_client.client import KVPoolClient
from kvpool_client.credentials import Credentials
from kvpool_client.errors import QuotaExceededError, ResourceExhaustedError
from kvpool_client.loadgen.chat import ChatConversation
from kvpool_client.loadgen.kv_path import map_pool, write_over_grpc
from kvpool_client.loadgen.sequences import Request
from kvpool_client.loadgen.verifier import Verifier
from kvpool_client.loadgen.worker_config import WorkerConfig
from kvpool_client.loadgen.workload import distribution, sequences_per_request


class Stopped(Exception):
    """The run is being stopped (the driver's SIGINT / SIGTERM, or the driver is gone): the worker ends its loop."""


class WorkerBase:
    def __init__(self, cfg: WorkerConfig, claim: Any, events: Any, stop: Any = None) -> None:
        self.cfg = cfg
        self.claim = claim
        self.events = events
        self._stop = stop  # the driver's stop Event (None: never asked to stop)
        self._parent = os.getppid()
        self.dist = distribution(cfg.lengths, cfg.max_len)
        self.width = sequences_per_request(cfg.mode, cfg.beam_width, cfg.num_samples)
        creds = (cfg.credentials or Credentials()).with_token(cfg.token)
        self.client = KVPoolClient(cfg.target, timeout=cfg.timeout, fast_path=cfg.fast_path, **creds.client_kwargs())
        self.pool, self.grpc_kv_why = map_pool(self.client, cfg.kv_path)  # every rank's shard; None: KV over gRPC (kv_path.py)
        self.layout = self.client.layout
        backend = self.pool.backend if self.pool is not None else "not mapped"
        if cfg.kv_source == "device" and backend != "gpu":
            raise RuntimeError(f"--kv-source device writes from GPU arrays into a mapped GPU pool; this server's pool "
                               f"is {backend}: use --kv-source host (or auto)")
        self.device_kv = cfg.kv_source == "device" or (cfg.kv_source == "auto" and backend == "gpu")
        self.active: list[Request] = []
        self.deferred: list[int] = []  # request indices to start (again) first: admission.py
        self.hold_admission = False  # after a preemption, until a request completes
        self.stalled_since: float | None = None  # this process's last request preempted, none finished since
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)
        self.used_blocks = 0
        self.series: dict[str, list[float]] = {k: [] for k in ("t", "used", "logical", "seqs", "tokens")}
        self.verifier = Verifier(self.client, self.pool, cfg.verify, self.timed, self.counts)
        self.next_turns: list[tuple[ChatConversation, int]] = []  # chat: turns whose previous turn just ended
        # shared-prefix, per request: (held from, held until, prompt id, physical block ids of the shared prompt,
        # how many of them were cached): resident.py
        self.prefix_holds: list[tuple[float, float, int, list[int], int]] = []

    # ---------------------------------------------------------------- what one part needs of another
    def prefill(self, seq_id: int, num_tokens: int, token_ids: np.ndarray | None = None) -> Any:
        """The prefill append of a new sequence (Admission)."""
        raise NotImplementedError

    def start_request(self, index: int) -> None:
        """Start request ``index`` of the run (Worker)."""
        raise NotImplementedError

    def start_chat_turn(self, conversation: ChatConversation, turn: int) -> Request:
        """A chat conversation's turn ``turn`` (PrefixRequests)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- plumbing
    def stopping(self) -> bool:
        """The driver asked the workers to stop, or is gone (a worker is never left loading the server alone)."""
        return (self._stop is not None and self._stop.is_set()) or os.getppid() != self._parent

    def timed(self, name: str, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.latency[name].append(time.perf_counter() - start)

    def append(self, name: str, seq_ids: list[int], num_tokens: int, token_ids: np.ndarray | None = None,
               wait: bool = True) -> Any:
        """AppendToken; on RESOURCE_EXHAUSTED retried for up to --exhausted-wait (``wait``) or raised at once."""
        deadline = time.monotonic() + (self.cfg.exhausted_wait_s if wait else -1.0)
        while True:
            try:
                result = self.timed(name, self._append_call, seq_ids, num_tokens, token_ids)
                break
            except ResourceExhaustedError as error:
                self.counts["exhausted_retries"] += 1
                self.counts["quota_refusals"] += isinstance(error, QuotaExceededError)
                if self.stopping():
                    raise Stopped from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)
        self.counts["append_calls"] += 1
        self.counts["fast_path_appends"] += self.client.fast_path_open  # over the shared-memory channel
        self.counts["tokens_appended"] += len(result.slot_mapping)
        self.counts["copies"] += len(result.copies)
        self.counts["blocks_allocated"] += len(result.new_block_ids)
        self.used_blocks += len(result.new_block_ids)
        return result

    def _append_call(self, seq_ids: list[int], num_tokens: int, token_ids: np.ndarray | None) -> Any:
        if token_ids is None:
            return self.client.append(seq_ids, num_tokens)
        return self.client.append(seq_ids, num_tokens, token_ids=token_ids)

    def claim_next(self) -> int | None:
        with self.claim.get_lock():
            index = self.claim.value
            if index >= self.cfg.completions:
                return None
            self.claim.value = index + 1
            return index

    def write_kv(self, slots: np.ndarray, data: np.ndarray, runs: list[tuple[int, int, int]]) -> None:
        """Write token KV into ``slots``: from host arrays, or (``--kv-source device``) from device arrays through
        the client's scatter kernel, then wait for it (other processes and the server read these slots next).
        ``runs``: the same tokens as ``(seq_id, start, num_tokens)``, for WriteKV when the pool is not mapped."""
        if self.pool is None:
            write_over_grpc(self.client, runs, data)
            return
        if not self.device_kv:
            self.pool.write_slots(slots, data)
            return
        import cupy  # noqa: PLC0415  (only on a GPU pool)

        stream = cupy.cuda.get_current_stream()
        self.pool.write_slots(cupy.asarray(np.asarray(slots, dtype=np.int64)), cupy.asarray(data), stream=stream)
        stream.synchronize()

    def record_prefix_hold(self, r: Request) -> None:
        """Which blocks held ``r``'s shared prompt, from when to now (resident.py)."""
        if r.prefix_block_ids is not None:
            self.prefix_holds.append((r.held_since, time.monotonic(), r.prompt_id, r.prefix_block_ids,
                                      r.prefix_blocks_cached))

    def _record(self) -> None:
        seqs = [s for r in self.active for s in r.seqs.values()]
        bs = self.layout.block_size
        s = self.series
        s["t"].append(time.monotonic())
        s["used"].append(self.used_blocks)
        s["logical"].append(sum(-(-q.length // bs) for q in seqs))
        s["seqs"].append(len(seqs))
        s["tokens"].append(sum(q.length for q in seqs))
