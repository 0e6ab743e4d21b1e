"""FairShare (the sessions' decayed usage, their max-min share, its bound) and PromptHasher (chunked hashes equal to
the inline ones), on a clock stepped by hand."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from kvpool_server.config import ServerConfig
from kvpool_server.service.build import build_service
from kvpool_server.service.fair_share import MIN_SHARE, PRUNE_S, TAU_S, FairShare, key_of


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fair(live: set[int]) -> tuple[FairShare, Clock]:
    clock = Clock()
    return FairShare(live, clock=clock), clock


def test_usage_decays_with_the_time_constant() -> None:
    share, clock = fair({1})
    share.charge(1, 0.05)
    clock.now += TAU_S
    assert math.isclose(share.usage(1), 0.05 / math.e)


def test_alone_a_session_is_never_over_its_share() -> None:
    share, _ = fair({1, 2})
    share.charge(1, TAU_S)  # the whole server
    assert share.wait_s(1) == 0 and share.pause_s(1) == 0


def test_a_flooder_is_held_to_what_the_others_leave_and_a_light_session_never_waits() -> None:
    share, clock = fair({1, 2, 3})
    share.charge(1, 0.95 * TAU_S)  # the flooder
    share.charge(2, 0.05 * TAU_S)
    share.charge(3, 0.05 * TAU_S)
    assert math.isclose(share.level(), 0.9 * TAU_S)  # what the two others leave of the server
    assert share.wait_s(2) == 0 and share.wait_s(3) == 0
    wait = share.wait_s(1)
    assert wait > 0
    clock.now += wait + 0.003
    assert share.wait_s(1) == 0  # decayed to its level: its turn


def test_over_share_names_only_the_sessions_over_it() -> None:
    """Empty -- the fast path then serves its channels round-robin -- while nobody is over, even with unequal
    usages; the flooder alone once it is."""
    share, clock = fair({1, 2, 3})
    share.charge_many({1: 0.5 * TAU_S, 2: 0.3 * TAU_S, 3: 0.1 * TAU_S})  # less than the whole server together
    assert share.over_share() == {}
    clock.now += 100 * TAU_S
    share.charge_many({1: 0.99 * TAU_S, 2: 0.03 * TAU_S, 3: 0.02 * TAU_S})
    assert list(share.over_share()) == [1]
    clock.now += 100 * TAU_S
    assert share.over_share() == {}  # decayed


def test_charge_many_is_a_charge_of_each() -> None:
    one, clock_one = fair({1, 2})
    many, clock_many = fair({1, 2})
    for share, clock in ((one, clock_one), (many, clock_many)):
        share.charge(1, 0.02)
        clock.now += 0.05
    one.charge(1, 0.01)
    one.charge(2, 0.03)
    many.charge_many({1: 0.01, 2: 0.03})
    assert math.isclose(one.usage(1), many.usage(1)) and math.isclose(one.usage(2), many.usage(2))


def test_heavy_work_gives_way_to_a_lighter_session_served_just_now_but_keeps_its_minimum() -> None:
    share, clock = fair({1, 2})
    share.charge(1, 0.5 * TAU_S)
    share.charge(2, 0.02 * TAU_S)  # a frontend stepping: served just now
    assert share.pause_s(1) > 0 and share.pause_s(2) == 0
    clock.now += 0.5  # its usage decayed below MIN_SHARE of the server: it runs, whoever asks
    assert share.usage(1) < MIN_SHARE * TAU_S and share.pause_s(1) == 0


def test_heavy_work_gives_way_to_a_light_session_even_a_more_used_one_but_not_to_other_heavy_work() -> None:
    """A frontend stepping back to back can use more of the server than a flooder's hashing does; the flooder's
    chunks still wait for it (it has no heavy work). Against another session with heavy work, usages decide."""
    share, clock = fair({1, 2, 3})
    share.charge(1, 0.3 * TAU_S, heavy=True)  # the flooder's chunks
    share.charge(2, 0.6 * TAU_S)  # a frontend's steps: more than the flooder, and light
    assert share.wait_s(1) == 0  # within its share
    assert share.pause_s(1) > 0
    clock.now += 100 * TAU_S
    share.charge(1, 0.3 * TAU_S, heavy=True)
    share.charge(3, 0.6 * TAU_S, heavy=True)  # more used, and heavy: the flooder's chunks do not wait for it
    assert share.pause_s(1) == 0 and share.pause_s(3) > 0
    share.check_invariants()


def test_entries_are_bounded_by_the_live_sessions_and_tenants() -> None:
    live = {1, 2}
    share, clock = fair(live)
    for session_id in range(1, 1000):  # ids that are not live are charged to their tenant's key
        share.charge(key_of(session_id, 7, live), 0.001)
    assert len(share) == 3  # sessions 1, 2 and tenant 7's key
    live.discard(2)  # the session ended
    clock.now += 1.5 * PRUNE_S
    share.charge(1, 0.001)
    assert len(share) == 2
    clock.now += 100 * TAU_S  # everything decayed
    share.charge(1, 0.0)
    assert len(share) == 0
    share.check_invariants()


def test_chunked_hashes_equal_the_inline_ones() -> None:
    config = ServerConfig(backend="host", num_blocks=256, head_dim=1, max_seq_len=1 << 16).validate()
    svc, _ = build_service(config)
    try:
        prefix = svc.guard.manager.prefix
        prompt = np.random.default_rng(0).integers(0, 50_000, 5000, dtype=np.uint32)
        for public, extra in ((0, b""), (800, b"lora"), (5000, b"")):
            done = threading.Event()
            job = svc.hasher.submit(-1, None, prompt, public, extra, lambda job, done=done: done.set())
            assert job is not None and done.wait(30)
            assert job.hashes == prefix.prompt_hashes(None, prompt, public, extra)
        assert svc.hasher.submit(-1, None, np.zeros(1 << 17, np.uint32), 0, b"", print) is None  # too long: refused
        svc.hasher.check_invariants()
    finally:
        svc.hasher.stop()
        svc.guard.pool.close()


def test_a_batchs_jobs_are_queued_at_once_hashed_in_shared_chunks_and_equal_the_inline_ones(monkeypatch) -> None:
    """``submit_many``: one job a prompt, all or none (a prompt register refuses: none queued; past the queue's
    bound: QuotaExceededError, none queued), ``on_done`` once, for the last; short prompts share a chunk."""
    from kvpool_server.core.errors import QuotaExceededError
    from kvpool_server.service import prompt_hasher

    config = ServerConfig(backend="host", num_blocks=256, head_dim=1, max_seq_len=1 << 16).validate()
    svc, _ = build_service(config)
    try:
        prefix, hasher = svc.guard.manager.prefix, svc.hasher
        rng = np.random.default_rng(1)
        prompts = [(rng.integers(0, 50_000, int(n), dtype=np.uint32), 0, b"k" if n % 2 else b"")
                   for n in (5, 100, 700, 17, 3000, 40)]
        assert hasher.submit_many(-1, None, prompts + [(np.zeros(1 << 17, np.uint32), 0, b"")], print) is None
        assert hasher.queued_tokens == 0 and not hasher.jobs.get(-1)
        monkeypatch.setattr(prompt_hasher, "MAX_QUEUED_TOKENS", 3000)
        with pytest.raises(QuotaExceededError):
            hasher.submit_many(-1, None, prompts, print)
        assert hasher.queued_tokens == 0
        monkeypatch.undo()
        chunks: list[float] = []  # the hasher charges its session once a chunk
        charge = svc.fair.charge
        monkeypatch.setattr(svc.fair, "charge", lambda key, s, heavy=False: (chunks.append(s), charge(key, s, heavy)))
        done: list = []
        finished = threading.Event()
        jobs = hasher.submit_many(-1, None, prompts, lambda job: (done.append(job), finished.set()))
        assert jobs is not None and finished.wait(30)
        assert done == [jobs[-1]] and all(job.done for job in jobs)
        for job, (prompt, public, extra) in zip(jobs, prompts):
            assert job.result == prefix.prompt_hashes(None, prompt, public, extra)
        chunk = prompt_hasher.HASHER_CHUNK_BLOCKS
        alone = sum(max(1, -(-job.num_blocks // chunk)) for job in jobs)  # a chunk or more each, unshared
        assert len(chunks) == -(-sum(job.num_blocks for job in jobs) // chunk) < alone, (len(chunks), alone)
        hasher.check_invariants()
        assert hasher.queued_tokens == 0
    finally:
        svc.hasher.stop()
        svc.guard.pool.close()
