"""The tensor-parallel benchmarks still run on the host backend and print their figures (nothing here is timed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.benchmarks.test_benchmarks_run import run_script


def test_tp_decode_step_prints_every_shard_count(tmp_path: Path) -> None:
    out = run_script("tp_decode_step.py", "--steps", "5", "--rounds", "1", "--num-blocks", "2048",
                     "--json", str(tmp_path / "rows.json"), timeout=120)
    for n in (1, 2, 4, 8):
        assert re.search(rf"N={n}:\s+[\d.]+ us \([\d.]+\)\s+[\d.]+ copies/step", out), out
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [r["tensor_parallel"] for r in rows] == [1, 2, 4, 8] and all(r["copies_per_step"] > 10 for r in rows)


def test_tp_copy_bandwidth_checks_its_copies() -> None:
    out = run_script("tp_copy_bandwidth.py", "--copies", "32", "--reps", "2", "--tensor-parallel", "1,2,4",
                     timeout=120)
    assert len(re.findall(r"N=\d on 1 device\(s\):.*GB/s a device.*x[\d.]+ of memcpy  correct", out)) == 3, out
