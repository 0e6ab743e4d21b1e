"""bench_vllm_gpu.py's dry run on the CPU (``--host-dry-run``: a host-backend server, the connector's worker, CPU
tensors read through the CUDA backends' views): it stores and loads a prompt through the worker, verifies every byte
(after the timed loads too) and prints each figure's line, ending "result: OK". The CUDA path itself runs on the
GPU machine (``scripts/gpu_check.sh vllm``). Nothing is timed or compared. Skipped without PyTorch."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tests.benchmarks.test_benchmarks_run import run_script  # noqa: E402


def test_bench_vllm_gpu_verifies_the_bytes_and_prints_every_figure_on_the_cpu() -> None:
    out = run_script("bench_vllm_gpu.py", "--host-dry-run", "--tokens", "64", "--repeats", "2", "--profile",
                     timeout=600)
    for layout in ("HND", "NHD"):
        assert f"[{layout}] bytes verified" in out, out
    for line in ("device memcpy (copy_)", "store vLLM -> kvpool", "load  kvpool -> vLLM", "load, new ids every call",
                 "load, new ids, back to back", "the load's host time", "cProfile of 400 loads"):
        assert line in out, line
    assert "MISMATCH" not in out and "FAILED" not in out
    assert out.strip().splitlines()[-1] == "result: OK"
