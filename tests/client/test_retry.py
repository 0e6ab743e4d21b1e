"""RetryPolicy and the retry loop (retry.py), run as a plan (plan.py) by a ``make`` that scripts each attempt's
outcome and records the pauses without sleeping: which attempts are made, how long each waits, when it gives up."""

from __future__ import annotations

import grpc
import pytest

from kvpool_client import RetryPolicy, rpcs
from kvpool_client.errors import DeadlineExceededError, NotFoundError, UnavailableError
from kvpool_client.plan import Attempt, Pause, run
from kvpool_client.retry import call_with_retries

NO_JITTER = RetryPolicy(max_attempts=4, initial_backoff_s=0.05, multiplier=2.0, max_backoff_s=0.15, jitter=0.0)


def test_backoff_grows_is_capped_and_jitters_within_bounds():
    assert [NO_JITTER.backoff(i) for i in range(4)] == pytest.approx([0.05, 0.1, 0.15, 0.15])
    jittery = RetryPolicy(initial_backoff_s=1.0, max_backoff_s=1.0, jitter=0.2)
    assert all(0.8 <= jittery.backoff(0) <= 1.2 for _ in range(200))


def test_only_idempotent_rpcs_get_more_than_one_attempt():
    assert NO_JITTER.attempts_for(rpcs.STATS) == 4 and NO_JITTER.attempts_for(rpcs.HEALTH_CHECK) == 4
    for rpc in (rpcs.REGISTER_SEQUENCE, rpcs.APPEND_TOKEN, rpcs.FORK, rpcs.FREE, rpcs.WRITE_KV):
        assert NO_JITTER.attempts_for(rpc) == 1


class Script:
    """Answers attempts with ``codes`` in turn (None: success) and records every step made."""

    def __init__(self, *codes: grpc.StatusCode | None) -> None:
        self.codes, self.steps = list(codes), []

    def __call__(self, step):
        self.steps.append(step)
        if isinstance(step, Pause):
            return None
        code = self.codes.pop(0)
        if code is not None:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="scripted")
        return "response"


def test_unavailable_is_retried_after_each_backoff_then_answered():
    make = Script(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, None)
    assert run(call_with_retries(rpcs.STATS, "request", 10.0, NO_JITTER), make) == "response"
    kinds = [type(step).__name__ for step in make.steps]
    assert kinds == ["Attempt", "Pause", "Attempt", "Pause", "Attempt"]
    assert [s.seconds for s in make.steps if isinstance(s, Pause)] == pytest.approx([0.05, 0.1])
    attempts = [s for s in make.steps if isinstance(s, Attempt)]
    assert all(a.request == "request" and 0 < a.timeout <= 10.0 for a in attempts)


@pytest.mark.parametrize(
    ("rpc", "codes", "error", "attempts"),
    [
        (rpcs.STATS, [grpc.StatusCode.UNAVAILABLE] * 4, UnavailableError, 4),  # out of attempts
        (rpcs.STATS, [grpc.StatusCode.NOT_FOUND], NotFoundError, 1),  # only UNAVAILABLE is retried
        (rpcs.APPEND_TOKEN, [grpc.StatusCode.UNAVAILABLE], UnavailableError, 1),  # mutating: never retried
    ],
)
def test_gives_up_with_the_last_attempts_exception(rpc, codes, error, attempts):
    make = Script(*codes)
    with pytest.raises(error) as info:
        run(call_with_retries(rpc, "request", 10.0, NO_JITTER), make)
    assert info.value.method == rpc.name
    assert sum(isinstance(step, Attempt) for step in make.steps) == attempts


def test_a_passed_deadline_ends_the_retries():
    make = Script()
    with pytest.raises(DeadlineExceededError, match="while retrying"):
        run(call_with_retries(rpcs.STATS, "request", 0.0, NO_JITTER), make)
    assert make.steps == []  # no time left: not even one attempt
