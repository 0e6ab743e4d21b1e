"""A register whose prompt comes back from the host tier crosses into the core in two lock holds -- the restore's
staging (the session fenced there), then the register -- and renews its session's lease once (issue 33)."""

from __future__ import annotations

from typing import Any

from tests.offload.test_service_host_tier import free, prompt_of
from tests.offload.test_tier_restore_unlocked import FULL, evicted_prompt
from tests.service.recording_lock import RecordingLock


def test_a_restoring_register_holds_the_lock_twice_and_renews_its_lease_once(tiered) -> None:
    svc, scope = tiered
    evicted_prompt(svc, scope)  # prompt 0 in the tier only
    sessions = svc.guard.sessions
    with svc.guard.lock:
        session = sessions.open("crossings")
    renewals: list[int] = []
    renew = sessions.renew

    def counted(session_id: int, tenant: Any = None) -> Any:
        renewals.append(session_id)
        return renew(session_id, tenant)

    sessions.renew = counted  # type: ignore[method-assign]
    lock = svc.guard.lock = RecordingLock()  # type: ignore[assignment]
    with scope.call("RegisterSequence") as call:
        seq, cached, _ = svc.register(call, session_id=session.session_id, prompt_token_ids=prompt_of(0))
    assert cached == FULL  # restored from the tier, in this call
    assert renewals == [session.session_id]  # once, in the restore's hold
    assert len(lock.holds) == 2  # the staging (and its stores), the register (and its events)
    sessions.renew = renew  # type: ignore[method-assign]
    free(svc, scope, seq)
