"""One load-generator process: keeps its share of the in-flight requests going until the run has N completions.

Per request: RegisterSequence, AppendToken(prompt_len) (the prefill), write the prompt's KV through attach(), and
for the sharing modes Fork the prompt into k beams / n samples. Then, per step, ONE AppendToken over every live
sequence of this process, and one write of all the new tokens' KV into the returned slots. A sequence that reaches
its length (or a beam that the rule prunes) is verified through its page table and freed; a finished request's
place is taken by the next unclaimed request index (a counter shared by all processes).

This process also keeps an exact record of its own memory: blocks held (AppendToken's new blocks minus Free's freed
blocks; no block is shared across processes) and blocks it would hold without sharing (sum of ceil(len / block_size)).
"""

from __future__ import annotations

import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool_client.client import KVPoolClient
from kvpool_client.errors import QuotaExceededError, ResourceExhaustedError
from kvpool_client.loadgen.pattern import KEY_MULTIPLIER, history_keys, kv_pattern, token_keys
from kvpool_client.loadgen.workload import (
    SHARED_WRITER_BASE,
    distribution,
    make_request,
    make_shared_prefix_request,
    prune_and_refork,
    request_token_ids,
    sequences_per_request,
    shared_token_ids,
)

EXHAUSTED_WAIT_S = 30.0  # how long a step waits for other processes to free blocks before it gives up


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: int
    target: str
    concurrency: int  # this process's share of the in-flight requests
    completions: int  # requests in the whole run
    seed: int = 0
    lengths: str = "uniform"
    max_len: int | None = None
    mode: str = "plain"
    beam_width: int = 4
    num_samples: int = 4
    prune_every: int = 4
    verify: str = "both"  # "table" (GetBlockTable + attached pool), "readkv" (ReadKV), "both"
    timeout: float = 30.0
    inject_errors: int = 0  # self-test: corrupt one token of the first sequence verified of requests 0..k-1
    exhausted_wait_s: float = EXHAUSTED_WAIT_S  # --exhausted-wait: how long a step waits for blocks to be freed
    # "host": KV written from NumPy arrays (the pool's host path: pinned staging on a GPU pool); "device": from CuPy
    # device arrays (pattern and slots uploaded first), one scatter kernel per write -- needs a GPU pool;
    # "auto": device on a GPU pool, host otherwise
    kv_source: str = "auto"
    token: str | None = None  # the bearer token this process calls with (--token, or its tenant's)
    tenant: str = ""  # --tenants: the tenant that token belongs to
    # --workload shared-prefix: each request = one of num_prompts shared prompts (shared_tokens) + unique_tokens of
    # its own, registered with its token ids (prefix caching); every appended token carries its id
    workload: str = "standard"
    num_prompts: int = 4
    shared_tokens: int = 8000
    unique_tokens: int = 1000


@dataclass
class Seq:
    seq_id: int
    name: int  # stable within its request (the beam rule ranks by it; server ids vary between runs)
    length: int
    target_len: int
    history: list[list[int]]  # [writer seq_id, start, stop): who wrote which positions
    last_slot: int = -1
    request_index: int = -1


@dataclass
class Request:
    index: int
    seqs: dict[int, Seq] = field(default_factory=dict)
    steps: int = 0
    next_name: int = 0
    corrupted: bool = False


class Worker:
    def __init__(self, cfg: WorkerConfig, claim: Any, events: Any) -> None:
        self.cfg = cfg
        self.claim = claim
        self.events = events
        self.dist = distribution(cfg.lengths, cfg.max_len)
        self.width = sequences_per_request(cfg.mode, cfg.beam_width, cfg.num_samples)
        self.client = KVPoolClient(cfg.target, timeout=cfg.timeout, token=cfg.token)
        self.pool = self.client.attach()
        self.layout = self.pool.layout
        if cfg.kv_source == "device" and self.pool.backend != "gpu":
            raise RuntimeError(f"--kv-source device writes from GPU arrays into a GPU pool; this server's pool is "
                               f"on the {self.pool.backend} backend: use --kv-source host (or auto)")
        self.device_kv = cfg.kv_source == "device" or (cfg.kv_source == "auto" and self.pool.backend == "gpu")
        self.active: list[Request] = []
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)
        self.used_blocks = 0
        self.series: dict[str, list[float]] = {k: [] for k in ("t", "used", "logical", "seqs", "tokens")}
        self.errors: list[str] = []

    # ---------------------------------------------------------------- plumbing
    def _timed(self, name: str, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.latency[name].append(time.perf_counter() - start)

    def _append(self, name: str, seq_ids: list[int], num_tokens: int, token_ids: np.ndarray | None = None) -> Any:
        deadline = time.monotonic() + self.cfg.exhausted_wait_s
        while True:
            try:
                result = self._timed(name, self._append_call, seq_ids, num_tokens, token_ids)
                break
            except ResourceExhaustedError as error:
                if time.monotonic() > deadline:
                    raise
                self.counts["exhausted_retries"] += 1
                self.counts["quota_refusals"] += isinstance(error, QuotaExceededError)
                time.sleep(0.005)
        self.counts["append_calls"] += 1
        self.counts["tokens_appended"] += len(result.slot_mapping)
        self.counts["copies"] += len(result.copies)
        self.counts["blocks_allocated"] += len(result.new_block_ids)
        self.used_blocks += len(result.new_block_ids)
        return result

    def _append_call(self, seq_ids: list[int], num_tokens: int, token_ids: np.ndarray | None) -> Any:
        if token_ids is None:
            return self.client.append(seq_ids, num_tokens)
        return self.client.append(seq_ids, num_tokens, token_ids=token_ids)

    def _claim_next(self) -> int | None:
        with self.claim.get_lock():
            index = self.claim.value
            if index >= self.cfg.completions:
                return None
            self.claim.value = index + 1
            return index

    def _record(self) -> None:
        seqs = [s for r in self.active for s in r.seqs.values()]
        bs = self.layout.block_size
        s = self.series
        s["t"].append(time.monotonic())
        s["used"].append(self.used_blocks)
        s["logical"].append(sum(-(-q.length // bs) for q in seqs))
        s["seqs"].append(len(seqs))
        s["tokens"].append(sum(q.length for q in seqs))

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        self.t_start = time.monotonic()
        self._record()
        while True:
            while len(self.active) < self.cfg.concurrency and (index := self._claim_next()) is not None:
                self.start_request(index)
            if not self.active:
                break
            self.decode_step()
            self.retire()
            self._record()
        self.t_end = time.monotonic()

    def start_request(self, index: int) -> None:
        if self.cfg.workload == "shared-prefix":
            self.start_shared_prefix_request(index)
            return
        spec = make_request(self.cfg.seed, index, self.dist, self.cfg.mode, self.cfg.num_samples)
        root = self._timed("register", self.client.register)
        result = self._append("append_prefill", [root], spec.prompt_len)
        self._write_kv(result.slot_mapping, kv_pattern(token_keys(root, 0, spec.prompt_len), self.layout))
        request = Request(index)
        seq_ids = [root]
        if self.width > 1:
            seq_ids += self._timed("fork", self.client.fork, root, self.width - 1)
            self.counts["forks"] += self.width - 1
        for name, seq_id in enumerate(seq_ids):
            output_len = spec.output_lens[name if self.cfg.mode == "parallel" else 0]
            history = [[root, 0, spec.prompt_len]]
            request.seqs[seq_id] = Seq(seq_id, name, spec.prompt_len, spec.prompt_len + output_len, history)
        request.next_name = len(seq_ids)
        self.counts["sequences"] += len(seq_ids)
        self.active.append(request)
        self._record()

    def start_shared_prefix_request(self, index: int) -> None:
        """Register with the prompt's token ids; append and write only the part that is not cached. The shared
        part's KV is a function of (prompt id, position), so a cached block holds what this request would write."""
        cfg = self.cfg
        spec = make_shared_prefix_request(cfg.seed, index, self.dist, cfg.num_prompts, cfg.shared_tokens,
                                          cfg.unique_tokens)
        shared, prompt_len = spec.shared_len, spec.prompt_len
        ids = np.concatenate([shared_token_ids(cfg.seed, spec.prompt_id, 0, shared),
                              request_token_ids(cfg.seed, index, shared, prompt_len)])
        root, cached = self._timed("register", self.client.register_prompt, ids)
        self.counts["prompt_tokens"] += prompt_len
        self.counts["cached_tokens"] += cached
        self.counts["requests_with_hit"] += cached > 0
        self.used_blocks += cached // self.layout.block_size  # held again (approximate: may be shared)
        result = self._append("append_prefill", [root], prompt_len - cached, ids[cached:])
        writer = SHARED_WRITER_BASE + spec.prompt_id
        keys = np.concatenate([token_keys(writer, min(cached, shared), shared),
                               token_keys(root, max(cached, shared), prompt_len)])
        self._write_kv(result.slot_mapping, kv_pattern(keys, self.layout))
        history = [[writer, 0, shared], [root, shared, prompt_len]]
        request = Request(index, next_name=1)
        request.seqs[root] = Seq(root, 0, prompt_len, spec.max_total_len, history, request_index=index)
        self.counts["sequences"] += 1
        self.active.append(request)
        self._record()

    def _write_kv(self, slots: np.ndarray, data: np.ndarray) -> None:
        """Write token KV into ``slots``: from host arrays, or (``--kv-source device``) from device arrays through
        the client's scatter kernel, then wait for it (other processes and the server read these slots next)."""
        if not self.device_kv:
            self.pool.write_slots(slots, data)
            return
        import cupy  # noqa: PLC0415  (only on a GPU pool)

        stream = cupy.cuda.get_current_stream()
        self.pool.write_slots(cupy.asarray(np.asarray(slots, dtype=np.int64)), cupy.asarray(data), stream=stream)
        stream.synchronize()

    def decode_step(self) -> None:
        """One batched AppendToken over every live sequence of this process, then one write of the new KV."""
        seqs = [s for r in self.active for s in r.seqs.values()]
        token_ids = None
        if self.cfg.workload == "shared-prefix":
            token_ids = np.concatenate([request_token_ids(self.cfg.seed, s.request_index, s.length, s.length + 1)
                                        for s in seqs])
        result = self._append("append_decode", [s.seq_id for s in seqs], 1, token_ids)
        keys = np.array([s.seq_id for s in seqs], dtype=np.uint64) * np.uint64(KEY_MULTIPLIER)
        keys += np.array([s.length for s in seqs], dtype=np.uint64)
        self._timed("write_slots", self._write_kv, result.slot_mapping, kv_pattern(keys, self.layout))
        for s, slot in zip(seqs, result.slot_mapping.tolist(), strict=True):
            s.last_slot = slot
            last = s.history[-1]
            if last[0] == s.seq_id and last[2] == s.length:
                last[2] += 1
            else:
                s.history.append([s.seq_id, s.length, s.length + 1])
            s.length += 1
        self.counts["decode_steps"] += 1
        for r in self.active:
            r.steps += 1

    def retire(self) -> None:
        """Verify and free finished sequences and pruned beams (one Free call); re-fork the best beams."""
        to_free: list[Seq] = []
        for r in self.active:
            done = [s for s in r.seqs.values() if s.length >= s.target_len]
            to_free += done
            if self.cfg.mode == "beam" and not done and r.steps % self.cfg.prune_every == 0 and len(r.seqs) > 1:
                to_free += self._prune(r)
        if not to_free:
            return
        for r in self.active:
            if r.index < self.cfg.inject_errors and not r.corrupted:
                victim = next((s for s in to_free if s.seq_id in r.seqs and s.last_slot >= 0), None)
                if victim is not None:
                    r.corrupted = True
                    self._corrupt(victim)
        for s in to_free:
            self.verify(s)
        freed = self._timed("free", self.client.free, [s.seq_id for s in to_free])
        self.used_blocks -= freed
        self.counts["blocks_freed"] += freed
        still_active = []
        for r in self.active:
            for s in to_free:
                r.seqs.pop(s.seq_id, None)
            if r.seqs:
                still_active.append(r)
            else:
                self.counts["completions"] += 1
                self.events.put(("done", self.cfg.worker_id, r.index, self.counts["tokens_appended"]))
        self.active = still_active

    def _prune(self, r: Request) -> list[Seq]:
        by_name = {s.name: s for s in r.seqs.values()}
        drop, best = prune_and_refork(sorted(by_name), self.cfg.seed, r.index, r.steps)
        for name in best:
            parent = by_name[name]
            (child_id,) = self._timed("fork", self.client.fork, parent.seq_id, 1)
            self.counts["forks"] += 1
            self.counts["sequences"] += 1
            history = [list(seg) for seg in parent.history]
            r.seqs[child_id] = Seq(child_id, r.next_name, parent.length, parent.target_len, history)
            r.next_name += 1
        self.counts["beams_pruned"] += len(drop)
        return [by_name[name] for name in drop]

    # ---------------------------------------------------------------- verification
    def _corrupt(self, s: Seq) -> None:
        """Self-test (--inject-errors): overwrite the sequence's last token with another token's KV."""
        wrong = kv_pattern(token_keys(s.seq_id, s.length, s.length + 1), self.layout)
        self.pool.write_slots([s.last_slot], wrong)
        self.counts["errors_injected"] += 1

    def verify(self, s: Seq) -> None:
        """Compare the sequence's KV, found through its page table, with what its writers wrote."""
        expected = kv_pattern(history_keys(s.history), self.layout)
        self.counts["tokens_verified"] += s.length
        if self.cfg.verify in ("table", "both"):
            table = self._timed("block_table", self.client.block_table, s.seq_id)
            if table.num_tokens != s.length:
                self._error(s, f"page table has {table.num_tokens} tokens, expected {s.length}", s.length)
            else:
                self._compare(s, "attached pool", self.pool.read_slots(table.slots()), expected)
        if self.cfg.verify in ("readkv", "both"):
            self._compare(s, "ReadKV", self._timed("read_kv", self.client.read_kv, s.seq_id), expected)

    def _compare(self, s: Seq, via: str, got: np.ndarray, expected: np.ndarray) -> None:
        if got.shape != expected.shape:
            self._error(s, f"{via}: shape {got.shape}, expected {expected.shape}", s.length)
            return
        bad = np.flatnonzero((got.reshape(len(got), -1) != expected.reshape(len(expected), -1)).any(axis=1))
        if bad.size:
            self._error(s, f"{via}: {bad.size} tokens differ, first at position {int(bad[0])}", int(bad.size))

    def _error(self, s: Seq, message: str, num_tokens: int) -> None:
        self.counts["verify_errors"] += num_tokens
        self.counts["checks_failed"] += 1
        if len(self.errors) < 10:
            self.errors.append(f"seq {s.seq_id} (len {s.length}): {message}")

    # ---------------------------------------------------------------- report
    def summary(self) -> dict[str, Any]:
        return {
            "worker_id": self.cfg.worker_id,
            "tenant": self.cfg.tenant,
            "counts": dict(self.counts),
            "latency": dict(self.latency),
            "series": self.series,
            "t_start": self.t_start,
            "t_end": self.t_end,
            "errors": self.errors,
            "used_blocks_at_end": self.used_blocks,
        }

    def close(self) -> None:
        self.client.close()


def worker_main(cfg: WorkerConfig, claim: Any, start: Any, events: Any) -> None:
    """Entry point of a spawned process: attach, say ready, wait for the start signal, run, report."""
    worker = None
    try:
        worker = Worker(cfg, claim, events)
        events.put(("ready", cfg.worker_id, None, None))
        start.wait()
        worker.run()
        events.put(("result", cfg.worker_id, worker.summary(), None))
    except BaseException:  # noqa: BLE001  (reported to the parent, which fails the run)
        partial = None if worker is None else {"tenant": cfg.tenant, "counts": dict(worker.counts)}
        events.put(("error", cfg.worker_id, traceback.format_exc(), partial))  # its counts so far, for the tenants
    finally:
        if worker is not None:
            worker.close()
