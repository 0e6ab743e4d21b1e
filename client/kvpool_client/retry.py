"""Retries: the policy (how many attempts, how long between them) and the one loop both clients run it in.

Every call has one deadline, set when it starts. An idempotent RPC (rpcs.py) that fails with UNAVAILABLE is tried
again after a backoff, until it succeeds, fails otherwise, runs out of attempts, or the deadline passes; every
other call is made once. Injectable, like redis-py's backoff.py: ``KVPoolClient(target, retry=RetryPolicy(...))``.

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

    def attempts_for(self, rpc: Rpc) -> int:
        return self.max_attempts if rpc.idempotent else 1


def time_left(deadline: float, method: str) -> float:
    """Seconds until ``deadline`` (time.monotonic()); DeadlineExceededError once it has passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceededError("deadline passed while retrying", method=method)
    return remaining


def call_with_retries(rpc: Rpc, request: Any, timeout: float, policy: RetryPolicy) -> Plan[Any]:
    """One call as a plan: attempts inside one deadline ``timeout`` seconds away, paused by ``policy``'s backoff.
    Returns the response; raises the last attempt's exception (errors.py)."""
    deadline = time.monotonic() + timeout
    attempts = policy.attempts_for(rpc)
    attempt = 0
    while True:
        try:
            return (yield Attempt(rpc, request, time_left(deadline, rpc.name)))
        except UnavailableError:
            if attempt + 1 >= attempts:
                raise
        yield Pause(min(policy.backoff(attempt), max(0.0, deadline - time.monotonic())))
        attempt += 1
