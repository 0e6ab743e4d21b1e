"""One load-generator process: keeps its share of the in-flight requests going until the run has N completions.

Per request: RegisterSequence, AppendToken(prompt_len) (the prefill), write the prompt's KV through attach(), and
for the sharing modes Fork the prompt into k beams / n samples. Then, per step, ONE AppendToken over every live
sequence of this process, and one write of all the new tokens' KV into the returned slots. A sequence that reaches
its length (or a beam that the rule prunes) is verified through its page table and freed; a finished request's
place is taken by the next unclaimed request index (a counter shared by all processes).

This process also keeps an exact record of its own memory: blocks held (AppendToken's new blocks minus Free's freed
blocks; no block is shared across processes) and blocks it would hold without sharing (sum of ceil(len / block_size)).

The process's state and call plumbing are worker_base.py; admission and preemption admission.py; the prefix-caching
workloads' requests (shared-prefix, chat turns) prefix_requests.py -- each a class that ``Worker`` inherits, none
importing another; verification is verifier.py; the per-request state is sequences.py.
"""

from __future__ import annotations

import signal
import time
import traceback
from typing import Any

import numpy as np

from kvpool_client.loadgen.admission import Admission
from kvpool_client.loadgen.chat import make_chat_conversation
from kvpool_client.loadgen.pattern import KEY_MULTIPLIER, kv_pattern, token_keys
from kvpool_client.loadgen.prefix_requests import PrefixRequests, decode_token_ids
from kvpool_client.loadgen.sequences import Request, Seq
from kvpool_client.loadgen.worker_base import Stopped
from kvpool_client.loadgen.worker_config import WorkerConfig
from kvpool_client.loadgen.workload import beam_token_stream, make_request, prune_and_refork

__all__ = ["Worker", "WorkerConfig", "worker_main"]


class Worker(Admission, PrefixRequests):
    """One process's loop: its state and plumbing are WorkerBase's (worker_base.py), admission and preemption
    Admission's (admission.py), the prefix-caching workloads' requests PrefixRequests' (prefix_requests.py)."""

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        """Until the run has its completions -- or the driver asks to stop (``stopping()``): then the requests in
        flight are left as they are, and closing the client (its session) frees their sequences."""
        self.t_start = time.monotonic()
        self._record()
        try:
            while not self.stopping():
                while len(self.active) < self.cfg.concurrency and not self.stopping() and self.admit():
                    self._record()
                if not self.active or self.stopping():
                    break
                self.decode_step()
                self.retire()
                self._record()
        except Stopped:
            pass
        self.counts["stopped_in_flight"] = len(self.active) if self.stopping() else 0
        self.t_end = time.monotonic()

    def start_request(self, index: int) -> None:
        cfg = self.cfg
        if cfg.workload == "shared-prefix":
            self.active.append(self.start_shared_prefix_request(index))
            return
        if cfg.workload == "chat":
            conversation = make_chat_conversation(cfg.seed, index, self.dist, cfg.num_turns, cfg.turn_tokens)
            self.active.append(self.start_chat_turn(conversation, 0))
            return
        spec = make_request(cfg.seed, index, self.dist, cfg.mode, cfg.num_samples)
        root = self.timed("register", self.client.register)
        result = self.prefill(root, spec.prompt_len)
        self.write_kv(result.slot_mapping, kv_pattern(token_keys(root, 0, spec.prompt_len), self.layout),
                      [(root, 0, spec.prompt_len)])
        request = Request(index)
        seq_ids = [root]
        if self.width > 1:
            seq_ids += self.timed("fork", self.client.fork, root, self.width - 1)
            self.counts["forks"] += self.width - 1
        for name, seq_id in enumerate(seq_ids):
            output_len = spec.output_lens[name if cfg.mode == "parallel" else 0]
            history = [[root, 0, spec.prompt_len]]
            request.seqs[seq_id] = Seq(seq_id, name, spec.prompt_len, spec.prompt_len + output_len, history)
        request.next_name = len(seq_ids)
        self.counts["sequences"] += len(seq_ids)
        self.active.append(request)

    def decode_step(self) -> None:
        """One batched AppendToken over every live sequence of this process, then one write of the new KV."""
        def live() -> list[Seq]:
            return [s for r in self.active for s in r.seqs.values()]

        with_ids = self.cfg.workload != "standard" and not self.cfg.no_prefix_cache
        result = self.decode_append(
            lambda: [s.seq_id for s in live()],
            lambda: decode_token_ids(self.cfg.seed, live()) if with_ids else None)
        if result is None:  # every request of this process was preempted
            return
        seqs = live()
        with np.errstate(over="ignore"):
            keys = np.array([s.writer for s in seqs], dtype=np.uint64) * np.uint64(KEY_MULTIPLIER)
            keys += np.array([s.length for s in seqs], dtype=np.uint64)
        self.timed("write_slots", self.write_kv, result.slot_mapping, kv_pattern(keys, self.layout),
                   [(s.seq_id, s.length, 1) for s in seqs])
        for s, slot in zip(seqs, result.slot_mapping.tolist(), strict=True):
            s.last_slot = slot
            last = s.history[-1]
            if last[0] == s.writer and last[2] == s.length:
                last[2] += 1
            else:
                s.history.append([s.writer, s.length, s.length + 1])
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
                    self.verifier.corrupt(victim)
        for s in to_free:
            self.verifier.verify(s)
        freed = self.timed("free", self.client.free, [s.seq_id for s in to_free])
        self.used_blocks -= freed
        self.counts["blocks_freed"] += freed
        still_active = []
        for r in self.active:
            for s in to_free:
                r.seqs.pop(s.seq_id, None)
            if r.seqs:
                still_active.append(r)
            else:
                self._request_done(r)
        self.active = still_active

    def _request_done(self, r: Request) -> None:
        """All its sequences are freed: record its prefix hold; a chat turn's conversation goes on to its next turn
        (in this process: the next turn needs this one sealed), and only its last turn completes the request."""
        self.hold_admission, self.stalled_since = False, None
        self.record_prefix_hold(r)
        if r.conversation is not None:
            self.counts["turns"] += 1
            if r.turn + 1 < r.conversation.num_turns:
                self.next_turns.append((r.conversation, r.turn + 1))
                return
        self.counts["completions"] += 1
        self.events.put(("done", self.cfg.worker_id, r.index, self.counts["tokens_appended"]))

    def _prune(self, r: Request) -> list[Seq]:
        by_name = {s.name: s for s in r.seqs.values()}
        drop, best = prune_and_refork(sorted(by_name), self.cfg.seed, r.index, r.steps)
        for name in best:
            parent = by_name[name]
            (child_id,) = self.timed("fork", self.client.fork, parent.seq_id, 1)
            self.counts["forks"] += 1
            self.counts["sequences"] += 1
            history = [list(seg) for seg in parent.history]
            r.seqs[child_id] = Seq(child_id, r.next_name, parent.length, parent.target_len, history,
                                   request_index=r.index, token_stream=beam_token_stream(r.index, r.next_name))
            r.next_name += 1
        self.counts["beams_pruned"] += len(drop)
        return [by_name[name] for name in drop]

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
            "errors": self.verifier.errors,
            "prefix_holds": self.prefix_holds,
            "used_blocks_at_end": self.used_blocks,
        }

    def close(self) -> None:
        self.client.close()


def worker_main(cfg: WorkerConfig, claim: Any, start: Any, events: Any, stop: Any = None) -> None:
    """Entry point of a spawned process: attach, say ready, wait for the start signal, run, report. SIGINT is the
    driver's to handle (a Ctrl-C reaches the whole process group): it sets ``stop``, and the worker reports what
    it did."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # spawn() blocked it for the start-up
    worker = None
    try:
        worker = Worker(cfg, claim, events, stop)
        events.put(("ready", cfg.worker_id, {"kv_path": "grpc" if worker.pool is None else "attach",
                                              "why": worker.grpc_kv_why}, None))
        while not start.wait(0.5) and not worker.stopping():  # a driver gone before the start: stop, not hang
            pass
        worker.run()
        events.put(("result", cfg.worker_id, worker.summary(), None))
    except BaseException:  # noqa: BLE001  (reported to the parent, which fails the run)
        partial = None if worker is None else {"tenant": cfg.tenant, "counts": dict(worker.counts)}
        events.put(("error", cfg.worker_id, traceback.format_exc(), partial))  # its counts so far, for the tenants
    finally:
        if worker is not None:
            worker.close()
