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
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool_client.errors import ResourceExhaustedError
from kvpool_client.loadgen import prefix_requests

if TYPE_CHECKING:
    from kvpool_client.loadgen.sequences import Request
    from kvpool_client.loadgen.worker import Worker

PREEMPT_LAST_AFTER_S = 1.0


class PrefillDeferred(Exception):
    """A new request's prefill did not fit while this process had requests running; it was freed."""


def prefill(w: Worker, seq_id: int, num_tokens: int, token_ids: np.ndarray | None = None) -> Any:
    """The prefill append of a new sequence (see the module docstring); raises PrefillDeferred."""
    if w.active:
        try:
            return w.append("append_prefill", [seq_id], num_tokens, token_ids, wait=False)
        except ResourceExhaustedError:
            w.timed("free", w.client.free, [seq_id])
            w.counts["prefill_deferrals"] += 1
            raise PrefillDeferred from None
    return w.append("append_prefill", [seq_id], num_tokens, token_ids)


def admit(w: Worker) -> bool:
    """Start the next request (a chat's next turn, a deferred request, a new index); False when there is none,
    admission is held after a preemption, or its prefill was deferred."""
    if w.hold_admission and w.active:
        return False
    w.hold_admission = False
    try:
        if w.next_turns:
            w.active.append(prefix_requests.start_chat_turn(w, *w.next_turns[0]))
            w.next_turns.pop(0)
        elif w.deferred:
            w.start_request(w.deferred[0])
            w.deferred.pop(0)
        elif (index := w.claim_next()) is not None:
            try:
                w.start_request(index)
            except PrefillDeferred:
                w.deferred.append(index)
                raise
        else:
            return False
    except PrefillDeferred:
        return False
    return True


def decode_append(w: Worker, seq_ids_of: Any, token_ids_of: Any) -> Any:
    """The decode step's AppendToken; preempts this process's youngest requests while the pool cannot take it.
    ``seq_ids_of()`` / ``token_ids_of()`` give the step's arguments for the requests still running. Returns None
    when every request of this process was preempted."""
    since = time.monotonic()
    while w.active:
        try:
            return w.append("append_decode", seq_ids_of(), 1, token_ids_of(), wait=False)
        except ResourceExhaustedError:
            now = time.monotonic()
            if len(w.active) > 1:
                preempt(w, w.active[-1])
            elif now - since > PREEMPT_LAST_AFTER_S:
                if w.stalled_since is not None and now - w.stalled_since > w.cfg.exhausted_wait_s:
                    raise  # restarting has not let any request finish for --exhausted-wait: give up
                w.stalled_since = w.stalled_since or now
                preempt(w, w.active[-1])
            else:
                time.sleep(0.005)
    return None


def preempt(w: Worker, r: Request) -> None:
    """Free every sequence of ``r`` (unverified: it did not finish) and queue it to start again."""
    freed = w.timed("free", w.client.free, list(r.seqs))
    w.used_blocks -= freed
    w.counts["blocks_freed"] += freed
    w.counts["preemptions"] += 1
    w.active.remove(r)
    w.record_prefix_hold(r)
    if r.conversation is not None:
        w.next_turns.insert(0, (r.conversation, r.turn))
    else:
        w.deferred.insert(0, r.index)
    w.hold_admission = True
