"""The benchmark scripts still run and print their figures (tiny durations; nothing here is timed or compared)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(*args: str, timeout: float) -> str:
    result = subprocess.run(
        [sys.executable, *args], cwd=BENCHMARKS, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_bench_core_prints_every_mode_and_checks_invariants() -> None:
    # bench_core calls manager.check_invariants() after each timed loop, so a broken plan fails this run.
    out = run_script("bench_core.py", "--seconds", "0.05", "--concurrency", "32", timeout=120)
    for mode in ("per-sequence", "batched", "persistent"):
        assert len(re.findall(rf"{mode}:\s+[\d.]+ M token-appends/s", out)) == 2, out
    assert re.search(r"best of 2: per-sequence [\d.]+ M/s, batched [\d.]+ M/s", out), out


def test_bench_service_prints_a_table_and_ratios() -> None:
    out = run_script(
        "bench_service.py", "--duration", "0.3", "--rounds", "1", "--no-aio", "--no-naive", "--clients", "1",
        "--kinds", "echo,kvpool,kvpool-stream", timeout=300,
    )
    for kind in ("echo", "kvpool", "kvpool-stream"):
        assert re.search(rf"^{kind}\s+1 client\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+$", out, re.M), out
    assert re.search(r"kvpool / echo \(1 client\): [\d.]+ \([\d.]+\)", out), out


def test_bench_events_prints_the_rate_and_checks_the_index() -> None:
    out = run_script("bench_events.py", "--seconds", "0.5", "--seqs", "8", "--max-seq-len", "1024",
                     "--num-blocks", "512", timeout=300)
    assert re.search(r"subscriber\s+[\d,]+ block events/s", out), out
    assert "equal to a fresh snapshot: True" in out and re.search(r"dropped\s+0 re-snapshots", out), out


def test_bench_fair_share_prints_each_frontend_alone_and_under_each_flood() -> None:
    out = run_script("bench_fair_share.py", "--rounds", "1", "--phase-s", "1", "--prompt-tokens", "2048",
                     timeout=300)
    for phase in ("alone", "flood-fast", "flood-grpc"):
        for frontend in ("fast-path", "gRPC"):
            assert re.search(rf"^{phase}\s+{frontend}\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.M), out
    assert "NOT used" not in out and "flooder:" in out, out


def test_bench_fair_cost_prints_the_cost_per_record_and_per_step() -> None:
    out = run_script("bench_fair_cost.py", "--records", "1000", timeout=300)
    assert re.search(r"^this tree: [\d.]+ us a record \(median of 7; minimum [\d.]+\)$", out, re.M), out
    out = run_script("bench_fair_cost.py", "--steps", "20", "--runs", "1", timeout=300)
    assert re.search(r"^this tree: [\d.]+ us of the fast-path thread a step \(median of 1", out, re.M), out
