"""The workload is a pure function of (seed, index); the beam rule is deterministic and keeps the width."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool_client.loadgen.workload import (
    beam_score,
    distribution,
    make_request,
    prune_and_refork,
    sequences_per_request,
)


def test_same_seed_same_requests_different_seed_different_requests():
    dist = distribution("uniform")
    a = [make_request(7, i, dist, "plain") for i in range(50)]
    b = [make_request(7, i, dist, "plain") for i in range(50)]
    c = [make_request(8, i, dist, "plain") for i in range(50)]
    assert a == b
    assert a != c
    # A request does not depend on which others were drawn before it.
    assert make_request(7, 31, dist, "plain") == a[31]


def test_uniform_lengths_follow_the_seed_rules():
    dist = distribution("uniform")
    specs = [make_request(0, i, dist, "plain") for i in range(3000)]
    prompts = np.array([s.prompt_len for s in specs])
    totals = np.array([s.prompt_len + s.output_lens[0] for s in specs])
    assert prompts.min() == 4 and prompts.max() == 32
    assert totals.min() == 32 and totals.max() == 256
    assert all(s.output_lens[0] >= 1 for s in specs)  # a target of 32 with a prompt of 32 still decodes 1 token
    assert abs(totals.mean() - 144) < 5  # uniform 32..256 has mean 144


@pytest.mark.parametrize(("name", "prompt_mean", "output_mean"), [("sharegpt", 161, 338), ("alpaca", 19, 58)])
def test_lognormal_means_match_the_paper(name, prompt_mean, output_mean):
    dist = distribution(name)
    specs = [make_request(1, i, dist, "plain") for i in range(20000)]
    prompts = np.array([s.prompt_len for s in specs])
    outputs = np.array([s.output_lens[0] for s in specs])
    assert abs(prompts.mean() / prompt_mean - 1) < 0.05
    assert abs(outputs.mean() / output_mean - 1) < 0.05
    assert (prompts >= 1).all() and (outputs >= 1).all()
    assert (prompts + outputs <= dist.max_len).all()


def test_max_len_clips_every_sequence():
    dist = distribution("sharegpt", max_len=300)
    for i in range(2000):
        spec = make_request(3, i, dist, "parallel", num_samples=3)
        assert len(spec.output_lens) == 3
        assert spec.max_total_len <= 300


def test_sequences_per_request():
    assert sequences_per_request("plain", 4, 6) == 1
    assert sequences_per_request("beam", 4, 6) == 4
    assert sequences_per_request("parallel", 4, 6) == 6


@pytest.mark.parametrize("width", [2, 3, 4, 6])
def test_beam_rule_is_deterministic_and_keeps_the_width(width):
    names = list(range(10, 10 + width))
    drop, best = prune_and_refork(names, seed=5, request_index=2, step=8)
    assert (drop, best) == prune_and_refork(list(reversed(names)), seed=5, request_index=2, step=8)
    assert len(drop) == len(best) == width // 2
    assert not set(drop) & set(best)
    assert set(drop) | set(best) <= set(names)
    # The survivors plus one fork of each best beam is the width again.
    assert width - len(drop) + len(best) == width
    scores = {n: beam_score(5, 2, 8, n) for n in names}
    assert min(scores[n] for n in best) >= max(scores[n] for n in drop)


def test_beam_rule_changes_with_step_and_seed():
    names = list(range(6))
    by_step = {tuple(prune_and_refork(names, 0, 0, step)[0]) for step in range(0, 80, 4)}
    by_seed = {tuple(prune_and_refork(names, seed, 0, 4)[0]) for seed in range(20)}
    assert len(by_step) > 3 and len(by_seed) > 3


def test_width_one_prunes_nothing():
    assert prune_and_refork([0], 0, 0, 4) == ([], [])
