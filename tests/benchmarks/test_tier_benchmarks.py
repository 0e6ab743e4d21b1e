"""The host tier's benchmarks run at a tiny size (issue 23; nothing here is timed): the sweep's JSON has both
lines and the tier's is at least the pool's where the prompts need 4x the pool; the start-up benchmark sees the
server SERVING, a register and an append served, and the whole tier ready."""

from __future__ import annotations

import json
from pathlib import Path

from .test_benchmarks_run import run_script

# 128 B blocks (head_dim 1); 16 prompts of 192 shared tokens = 192 blocks: 4x the smallest pool, which still holds
# the 2 requests in flight (at most 12 + 1 + 3 blocks each); 512 blocks hold everything. The tier (256 KiB): 2,048 blocks.
SWEEP = ("--pool-blocks", "48,512", "--num-prompts", "16", "--shared-tokens", "192", "--unique-tokens", "16",
         "--max-len", "48", "-p", "1", "-c", "2", "-n", "64", "--head-dim", "1", "--host-tier-bytes", "256KiB")
ROW_KEYS = {"pool_blocks", "host_tier", "rc", "token_hit_rate", "cached_tokens", "prompt_tokens", "verify_errors"}


def test_the_tier_sweep_has_both_lines_and_the_tier_keeps_the_hits(tmp_path: Path) -> None:
    out, png = tmp_path / "tier.json", tmp_path / "tier.png"
    stdout = run_script("prefix_sweep.py", *SWEEP, "--json", str(out), "--plot", str(png), timeout=600)
    result = json.loads(out.read_text())
    rows, tier_rows = result["rows"], result["tier_rows"]
    assert [r["pool_blocks"] for r in rows] == [r["pool_blocks"] for r in tier_rows] == [48, 512], stdout
    for r in rows + tier_rows:
        assert ROW_KEYS <= r.keys() and r["rc"] == 0 and r["verify_errors"] == 0, r
    assert not any(r["host_tier"] for r in rows) and all(r["host_tier"] for r in tier_rows)
    for r in tier_rows:  # the server's own tier figures, beside the load generator's
        assert r["tier"]["num_blocks"] == 2048 and r["prefix_host_hit_tokens"] >= 0, r
    small, small_tier = rows[0], tier_rows[0]
    print("pool only:", small["token_hit_rate"], "with the tier:", small_tier["token_hit_rate"])
    assert small_tier["token_hit_rate"] >= small["token_hit_rate"]
    assert small_tier["tier"]["num_blocks_restored"] > 0 and small_tier["prefix_host_hit_tokens"] > 0
    summary = result["summary"]
    assert summary["reference_pool_blocks"] == 512
    assert summary["reference_token_hit_rate"] == rows[1]["token_hit_rate"]
    assert set(summary["tier_over_reference"]) == {"48", "512"}
    assert png.stat().st_size > 0 and "with the tier / reference" in stdout


def test_bench_tier_startup_serves_before_or_at_tier_ready(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    stdout = run_script("bench_tier_startup.py", "--backend", "host", "--host-tier-bytes", "8MiB", "--num-blocks",
                        "256", "--json", str(out), timeout=300)
    r = json.loads(out.read_text())
    assert r["bytes_total"] == 8 << 20 and r["tier_blocks"] == 256, stdout  # 32 KiB blocks
    assert r["ready_s"] is not None and r["serving_s"] <= r["ready_s"], stdout
    assert 0 <= r["bytes_ready_at_serving"] <= r["bytes_total"] == r["bytes_ready_at_end"]
    assert r["ready_at_serving"] == (r["bytes_ready_at_serving"] == r["bytes_total"])
    assert [b for _, b in r["samples"]] == sorted(b for _, b in r["samples"])  # ready only grows
    calls = r["calls"]
    assert calls["num_cached_tokens"] == 0 and calls["prompt_tokens"] == 64 and calls["at_s"] >= r["serving_s"]
    assert r["gauges_at_end"] == {"kvpool_host_tier_ready_bytes": 8 << 20, "kvpool_host_tier_size_bytes": 8 << 20}
    assert r["server_rc"] == 0
    assert "SERVING after" in stdout and "tier ready after" in stdout


def test_bench_tier_append_and_the_write_back_steps_run() -> None:
    """The decode step under churn (the churn thread failing fails the run: it once died at its first register,
    and the figures were of no churn) and the write-back's steps one at a time, at a tiny size."""
    out = run_script("bench_tier.py", "--sections", "append", "--decode-seqs", "4", "--decode-steps", "64",
                     "--prompt-blocks", "4", timeout=300)
    assert out.count("lock holds p99") == 2 and "p99 with / without" in out, out
    out = run_script("bench_tier_writeback.py", "--rounds", "64", "--decode-seqs", "4", "--prompt-blocks", "4",
                     timeout=300)
    assert "write-back step (lock hold)" in out and "decode step (lock hold)" in out, out
    assert int(out.split("blocks written back ")[1].split(",")[0]) > 0, out  # the churn evicts: the steps copy
