"""How a load-generator process admits and preempts requests when the pool is full, the way a serving scheduler
does (vLLM's recompute preemption), so that processes sharing a small pool never wait on each other forever:

- **Admission.** A new request's prefill that the pool cannot take now, while this process has requests running,
  frees the new sequence and is *deferred* (``PrefillDeferred``): the running requests keep decoding and free
  blocks. With none running, the prefill waits for blocks (up to ``--exhausted-wait``) like any step.
- **Preemption.** A decode step the pool cannot take preempts this process's youngest request: its sequences are
  freed and it starts again from its prompt later (with prefix caching, its prompt's sealed blocks are likely
  still cached). The last running request is preempted too once it has waited ``PREEMPT_LAST_AFTER_S``: another
  process may hold the blocks it needs; when no request of this process has finished for ``--exhausted-wait``
  since such a preemption, the step fails instead (the pool is too small for what runs). After a preemption no request is admitted until one completes or none
  runs, so a process does not take back the blocks it just gave up.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvpool_client.errors import ResourceExhaustedError
from kvpool_client.loadgen.sequences import Request
from kvpool_client.loadgen.worker_base import WorkerBase


PREEMPT_LAST_AFTER_S = 1.0


class PrefillDeferred(Exception):
    """A new request's prefill did not fit while this process had requests running; it was freed."""


class Admission(WorkerBase):
    """A process's admission and preemption (the module docstring): a part of ``Worker`` (worker_base.py)."""

    def prefill(self, seq_id: int, num_tokens: int, token_ids: np.ndarray | None = None) -> Any:
        """The prefill append of a new sequence (see the module docstring); raises PrefillDeferred."""
        if self.active:
            try:
                return self.append("append_prefill", [seq_id], num_tokens, token_ids, wait=False)
            except ResourceExhaustedError:
                self.timed("free", self.client.free, [seq_id])
                self.counts["prefill_deferrals"] += 1
                raise PrefillDeferred from None
        return self.append("append_prefill", [seq_id], num_tokens, token_ids)

    def admit(self) -> bool:
        """Start the next request (a chat's next turn, a deferred request, a new index); False when there is none,
        admission is held after a preemption, or its prefill was deferred."""
        if self.hold_admission and self.active:
            return False
        self.hold_admission = False
        try:
            if self.next_turns:
                self.active.append(self.start_chat_turn(*self.next_turns[0]))
                self.next_turns.pop(0)
            elif self.deferred:
                self.start_request(self.deferred[0])
                self.deferred.pop(0)
            elif (index := self.claim_next()) is not None:
                try:
                    self.start_request(index)
                except PrefillDeferred:
                    self.deferred.append(index)
                    raise
            else:
                return False
        except PrefillDeferred:
            return False
        return True

    def decode_append(self, seq_ids_of: Any, token_ids_of: Any) -> Any:
        """The decode step's AppendToken; preempts this process's youngest requests while the pool cannot take it.
        ``seq_ids_of()`` / ``token_ids_of()`` give the step's arguments for the requests still running. Returns
        None when every request of this process was preempted."""
        since = time.monotonic()
        while self.active:
            try:
                return self.append("append_decode", seq_ids_of(), 1, token_ids_of(), wait=False)
            except ResourceExhaustedError:
                now = time.monotonic()
                if len(self.active) > 1:
                    self.preempt(self.active[-1])
                elif now - since > PREEMPT_LAST_AFTER_S:
                    if self.stalled_since is not None and now - self.stalled_since > self.cfg.exhausted_wait_s:
                        raise  # restarting has not let any request finish for --exhausted-wait: give up
                    self.stalled_since = self.stalled_since or now
                    self.preempt(self.active[-1])
                else:
                    time.sleep(0.005)
        return None

    def preempt(self, r: Request) -> None:
        """Free every sequence of ``r`` (unverified: it did not finish) and queue it to start again."""
        freed = self.timed("free", self.client.free, list(r.seqs))
        self.used_blocks -= freed
        self.counts["blocks_freed"] += freed
        self.counts["preemptions"] += 1
        self.active.remove(r)
        self.record_prefix_hold(r)
        if r.conversation is not None:
            self.next_turns.insert(0, (r.conversation, r.turn))
        else:
            self.deferred.insert(0, r.index)
        self.hold_admission = True
