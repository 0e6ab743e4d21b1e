"""bench_ttft.py runs end to end on the CPU (tiny model, a host-backend server, a writer process, both variants)
and ends with its one line; the hit serves the prefix from the pool and gives the recompute's tokens. Nothing is
timed or compared. Skipped without PyTorch and transformers."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.benchmarks.test_benchmarks_run import run_script  # noqa: E402


def test_bench_ttft_ends_with_its_line_on_the_cpu(tmp_path) -> None:
    out = run_script("bench_ttft.py", "--device", "cpu", "--tiny", "--prefix", "64", "--suffix", "8", "--repeats",
                     "2", "--new-tokens", "3", "--json", str(tmp_path / "ttft.json"), timeout=600)
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"prefix reuse: 64/72 prompt tokens served from the pool; TTFT hit [0-9.]+ ms vs recompute "
                        r"[0-9.]+ ms \([0-9.]+x\); tokens identical: yes", last), last
    result = json.loads((tmp_path / "ttft.json").read_text())
    assert result["kvpool"]["cached"] == result["in-process"]["cached"] == 64
    assert result["kvpool"]["prefix_hit_tokens"] >= 3 * 64  # the warm-up's hit and both repeats'


def test_bench_ttft_serves_the_prefix_from_the_host_tier_on_the_cpu(tmp_path) -> None:
    """``--tier``: every timed hit found its prefix (4 blocks) cached, most of it only in the host tier (restored by
    the register), and gave the recompute's tokens."""
    out = run_script("bench_ttft.py", "--device", "cpu", "--tiny", "--prefix", "64", "--suffix", "8", "--repeats",
                     "2", "--new-tokens", "3", "--tier", "--json", str(tmp_path / "ttft.json"), timeout=600)
    assert re.search(r"^host tier : TTFT hit +[0-9.]+ ms \(64/72 cached, blocks restored per hit [0-9]-[0-9]\).*tokens "
                     r"identical: yes$", out, re.M), out
    tier = json.loads((tmp_path / "ttft.json").read_text())["host tier"]
    assert len(tier["restored_blocks"]) == 2 and min(tier["restored_blocks"]) >= 2, tier["restored_blocks"]
    assert tier["cached"] == 64 and tier["tokens_identical"]


def test_bench_ttft_chat_workload_on_the_cpu(tmp_path) -> None:
    """Four engine processes on one server, then four private ones: the same answers, and more prompt tokens from
    the shared cache than from the private ones (a conversation's next turn lands on another engine)."""
    out = run_script("bench_ttft.py", "--device", "cpu", "--tiny", "--workload", "chat", "--systems", "1",
                     "--system-tokens", "40", "--conversations", "4", "--turns", "2", "--user-tokens", "20",
                     "--new-tokens", "2", "--json", str(tmp_path / "chat.json"), timeout=600)
    assert re.search(r"chat: TTFT p50 [0-9.]+ ms shared vs [0-9.]+ ms private .* tokens identical: yes$", out.strip())
    result = json.loads((tmp_path / "chat.json").read_text())
    assert result["shared"]["requests"] == result["private"]["requests"] == 8
    assert result["shared"]["cached_share"] > result["private"]["cached_share"]
