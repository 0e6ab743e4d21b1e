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
