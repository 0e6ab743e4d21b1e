"""kvpool round trips in vLLM's own scheduler (in this process, no model: benchmarks/bench_vllm_connector.py's
harness) on a real kvpool server: none on a step that only decodes, one RegisterSequence per new request plus at
most one AppendToken and one Free a step; the same prompts again on a fresh vLLM find their blocks in kvpool."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` installs it (CPU) and runs these")

from benchmarks.bench_vllm_connector import make_scheduler, run, summary  # noqa: E402
from tests.conftest import start_server  # noqa: E402
from tests.vllm.tiny_model import BLOCK_SIZE, server_layout_args, write_tiny_llama  # noqa: E402


def test_round_trips_per_step_and_a_second_scheduler_loads_from_kvpool(tmp_path):
    server = start_server(tmp_path, "--num-blocks", "2048", *server_layout_args(), unix=True)
    try:
        model = write_tiny_llama(tmp_path / "model")
        prompts = [[(i * 7919 + j * 31) % 500 + 3 for j in range(300)] for i in range(8)]
        first = make_scheduler(model, server.address, 1024, 4)
        steps = run(first, prompts, 8)
        first.connector.shutdown()
        figures = summary(steps)
        assert figures["decode_only_steps"] > 0 and figures["round_trips_on_decode_only_steps"] == 0, figures
        for step in steps:
            if step["new"]:
                assert step["trips"] <= 4 + 2, step  # 4 registers (misses: no block table), one append, one free
            elif step["stores"]:
                assert step["trips"] <= 2, step
        assert not any(step["loaded_blocks"] for step in steps)
        second = make_scheduler(model, server.address, 1024, 4)
        again = run(second, prompts, 8)
        second.connector.shutdown()
        assert sum(step["loaded_blocks"] for step in again) == 8 * (299 // BLOCK_SIZE)
    finally:
        server.stop()
