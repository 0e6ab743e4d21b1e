"""Greedy tokens of two models compared where the reference decided them: step by step until the first step whose
two best reference logits are closer than the logits' measured error allows (a near tie, which that error may flip
-- seen on the H200: top-2 logits 7.336 / 7.320 in float16, and transformers' own fused and unfused paths pick
differently). Before that step the tokens must be identical; after it the sequences have legitimately parted."""

from __future__ import annotations

from typing import Any


def decided_steps(reference_logits: Any, rel_error: float) -> int:
    """How many leading steps of ``reference_logits`` ([steps, V], the reference's logits at each of its own greedy
    steps) are decided: their top-2 margin exceeds twice ``rel_error`` times the largest |logit| (each of two logits
    may move by that much)."""
    scale = float(reference_logits.abs().max())
    top2 = reference_logits.float().topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    return next((i for i, m in enumerate(margins) if m <= 2 * rel_error * scale), len(margins))


def assert_same_until_tie(ours: list[int], theirs: list[int], reference_logits: Any, rel_error: float) -> int:
    """Assert ``ours`` equals ``theirs`` over the steps the reference decided; returns how many were compared."""
    n = decided_steps(reference_logits, rel_error)
    assert ours[:n] == theirs[:n], (ours, theirs, f"{n} decided steps")
    return n
