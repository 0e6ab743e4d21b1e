"""The prefill graphs' context buckets: every context fits its bucket, powers of two up to CONTEXT_FINE_FROM,
then eight buckets an octave -- a 4,096-token hit's context is padded by at most a sixteenth, and the graphs a long
``max_context`` can need stay few."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the prefill graphs need PyTorch")

from kvpool_client.integrations.prefill_graphs import CONTEXT_FINE_FROM, MIN_CONTEXT, context_bucket  # noqa: E402


def test_every_context_fits_a_bucket_of_bounded_padding() -> None:
    previous = 0
    for n in range(1, 70_000):
        b = context_bucket(n)
        assert b >= max(n, MIN_CONTEXT) and b >= previous  # fits, and never shrinks as the context grows
        if n > CONTEXT_FINE_FROM:
            assert (b - n) * 16 < 1 << (n - 1).bit_length()  # padded by less than a sixteenth of its octave
        else:
            assert b & (b - 1) == 0  # a power of two
        previous = b
    assert context_bucket(4352) == 4608 and context_bucket(4096) == 4096 and context_bucket(2049) == 2304


def test_a_long_context_range_needs_few_buckets() -> None:
    buckets = {context_bucket(n) for n in range(1, 131_072 + 1)}
    # 256..2048: 4 powers of two; then 8 an octave for 2k-4k, 4k-8k, ..., 64k-128k (6 octaves)
    assert len(buckets) == 4 + 8 * 6
