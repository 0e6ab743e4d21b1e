"""Retries: the policy (how many attempts, how long between them) and the one loop both clients run it in.

Every call has one deadline, set when it starts. An idempotent RPC (rpcs.py) that fails with UNAVAILABLE is tried
again after a backoff, until it succeeds, fails otherwise, runs out of attempts, or the deadline passes. A mutation
that carries a ``request_id`` (a session's) is retried too, the same request again, on UNAVAILABLE and on
DEADLINE_EXCEEDED: the server applies a request id once and answers a repeat with the first answer. Each of its
attempts gets the whole ``timeout`` (a deadline that passed leaves none for a retry). Every other call is made
once. Injectable, like redis-py's backoff.py: ``KVPoolClient(target, retry=RetryPolicy(...))``.

    attempt:   0        1            2                  3
               |--x--|..|--x--|......|--x--|............|--ok--|     x: UNAVAILABLE   ..: backoff(i), never
                      50ms           100ms              200ms           past the deadline
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from kvpool_client.errors import DeadlineExceededError, UnavailableError
from kvpool_client.plan import Attempt, Pause, Plan
from kvpool_client.rpcs import Rpc


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff for idempotent calls that failed with UNAVAILABLE: attempt i waits initial * multiplier**i (capped,
    with +-jitter), and never past the call's deadline. ``max_attempts=1`` turns retries off."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.05
    multiplier: float = 2.0
    max_backoff_s: float = 1.0
    jitter: float = 0.2

    def backoff(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**attempt)
        return base * (1.0 + random.uniform(-self.jitter, self.jitter))

    def attempts_for(self, rpc: Rpc, deduplicated: bool = False) -> int:
        return self.max_attempts if rpc.idempotent or deduplicated else 1


def time_left(deadline: float, method: str) -> float:
    """Seconds until ``deadline`` (time.monotonic()); DeadlineExceededError once it has passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceededError("deadline passed while retrying", method=method)
    return remaining


def call_with_retries(rpc: Rpc, request: Any, timeout: float, policy: RetryPolicy) -> Plan[Any]:
    """One call as a plan: attempts inside one deadline ``timeout`` seconds away, paused by ``policy``'s backoff.
    Returns the response; raises the last attempt's exception (errors.py)."""
    deduplicated = bool(getattr(request, "request_id", 0))
    attempts = policy.attempts_for(rpc, deduplicated)
    retried = (UnavailableError, DeadlineExceededError) if deduplicated else (UnavailableError,)
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        if deduplicated:
            deadline = time.monotonic() + timeout  # each attempt of a deduplicated mutation has the whole timeout
        try:
            return (yield Attempt(rpc, request, time_left(deadline, rpc.name)))
        except retried as error:
            if attempt + 1 >= attempts or getattr(error, "permanent", False):  # waiting would not cure it
                raise
        yield Pause(min(policy.backoff(attempt), max(0.0, deadline - time.monotonic())) if not deduplicated
                    else policy.backoff(attempt))
        attempt += 1
