"""Series -> summary arithmetic, on hand-made series with known answers."""

from __future__ import annotations

import pytest

from kvpool_client.loadgen.metrics import (
    latency_summary,
    memory_summary,
    merge_step_series,
    sharing_summary,
    time_weighted_mean,
)


def test_time_weighted_mean_is_a_step_function_average():
    # 10 during [0, 1), 20 during [1, 4): mean over [0, 4] = (10 + 60) / 4.
    assert time_weighted_mean([0, 1], [10, 20], 0, 4) == pytest.approx(17.5)
    # A sample before the window holds into it; the window clips.
    assert time_weighted_mean([-5, 2], [6, 0], 0, 4) == pytest.approx(3.0)


def test_merge_step_series_sums_processes():
    t, v = merge_step_series([([0, 2], [1, 3]), ([1, 3], [10, 0])])
    assert t.tolist() == [0, 1, 2, 3]
    assert v.tolist() == [1, 11, 13, 3]


def test_latency_percentiles():
    row = latency_summary([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert row["count"] == 100
    assert row["p50_ms"] == pytest.approx(50.5)
    assert row["p99_ms"] == pytest.approx(99.01)
    assert latency_summary([])["count"] == 0


def test_memory_summary_peak_fragmentation_and_naive():
    stats = {  # block_size 4; 2 sequences for [0, 2), 1 for [2, 4)
        "t": [0, 1, 2, 3],
        "used": [2, 4, 2, 2],
        "unused": [1, 2, 3, 3],
        "tokens": [7, 14, 5, 5],
        "seqs": [2, 2, 1, 1],
    }
    mem = memory_summary(stats, t0=0, t1=4, num_blocks=100, block_size=4, block_bytes=64,
                         naive_blocks_per_seq=8, naive_peak_seqs=2)
    assert mem["peak_used_blocks"] == 4 and mem["peak_used_bytes"] == 256
    assert mem["peak_utilization"] == pytest.approx(0.04)
    assert mem["avg_utilization"] == pytest.approx((2 + 4 + 2 + 2) / 4 / 100)
    assert mem["internal_fragmentation_at_peak"] == pytest.approx(2 / 16)
    assert mem["internal_fragmentation_avg"] == pytest.approx((1 + 2 + 3 + 3) / (4 * (2 + 4 + 2 + 2)))
    assert mem["external_fragmentation"] == 0.0
    assert mem["naive_peak_blocks"] == 16 and mem["paged_over_naive_peak"] == pytest.approx(4 / 16)
    # Naive holds 2 * 8 * 4 = 64 slots for 2 time units, 32 for 2: tokens 7+14+5+5 over 64+64+32+32.
    assert mem["kv_used_for_tokens_naive"] == pytest.approx(31 / 192)


def test_sharing_summary_from_two_workers():
    w1 = {"t": [0, 2], "used": [4, 4], "logical": [8, 8]}
    w2 = {"t": [1, 3], "used": [2, 0], "logical": [2, 0]}
    share = sharing_summary([w1, w2], 0, 4)
    # used: 4, 6, 6, 4 per unit; logical: 8, 10, 10, 8.
    assert share["avg_blocks_with_sharing"] == pytest.approx(5.0)
    assert share["avg_blocks_without_sharing"] == pytest.approx(9.0)
    assert share["blocks_saved_avg"] == pytest.approx(1 - 5 / 9)
    assert share["peak_blocks_with_sharing"] == 6 and share["peak_blocks_without_sharing"] == 10


def test_progress_bar_draws_only_when_enabled():
    import io
    import re

    from kvpool_client.loadgen.dashboard import ProgressBar

    stream = io.StringIO()  # not a terminal: off by default
    bar = ProgressBar(10, stream=stream)
    bar.update(5, 100)
    bar.close()
    assert stream.getvalue() == ""
    bar = ProgressBar(10, enabled=True, stream=stream)
    bar.update(10, 1234)
    bar.close()
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", stream.getvalue())  # rich's colours
    assert "10/10 completions" in text and "1,234 tokens" in text
    assert "━" * 30 in text
