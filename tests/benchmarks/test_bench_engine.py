"""bench_engine.py still runs end to end on the CPU (tiny model, a host-backend server, both variants) and prints
its table; nothing here is timed or compared. Skipped without PyTorch and transformers."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.benchmarks.test_benchmarks_run import run_script  # noqa: E402


def test_bench_engine_prints_the_table_on_the_cpu(tmp_path) -> None:
    out = run_script("bench_engine.py", "--device", "cpu", "--tiny", "--steps", "2", "--batches", "1,3",
                     "--json", str(tmp_path / "engine.json"), timeout=600)
    assert "overhead" in out and "FAILED" not in out
    rows = json.loads((tmp_path / "engine.json").read_text())["rows"]
    assert [(r["context"], r["batch"]) for r in rows] == [(512, 1), (512, 3)]
    assert all(r["kvpool"]["step_s"] > 0 and r["in_process"]["step_s"] > 0 for r in rows)
