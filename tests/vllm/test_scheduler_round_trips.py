"""kvpool round trips in vLLM's own scheduler (in this process, no model: benchmarks/bench_vllm_connector.py's
harness) on a real kvpool server: one at most a step, whatever the number of requests -- its lookups (the
reply carries the cached blocks: no GetBlockTable), the last step's prompt stores, finished requests' stores,
seals and frees in one step record -- and none on a step that only decodes; the same prompts again on a fresh
vLLM find their blocks in kvpool. A request past a lookup's bounds waits one step for the next lookup."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` installs it (CPU) and runs these")

from benchmarks.bench_vllm_connector import make_scheduler, run, summary  # noqa: E402
from tests.conftest import start_server  # noqa: E402
from tests.grpc_counting import counting_grpc  # noqa: E402
from tests.vllm.tiny_model import BLOCK_SIZE, server_layout_args, write_tiny_llama  # noqa: E402

from kvpool_client.integrations.vllm import scheduler as connector_scheduler  # noqa: E402

PROMPTS = [[(i * 7919 + j * 31) % 500 + 3 for j in range(300)] for i in range(12)]


def check_steps(steps: list[dict]) -> None:
    figures = summary(steps)
    assert figures["decode_only_steps"] > 0 and figures["round_trips_on_decode_only_steps"] == 0, figures
    for step in steps:
        assert step["trips"] <= 1, step  # the step's lookups, stores, seals and frees: one call, whatever the number
        assert step["registers"] <= step["trips"], step
        if step["copies_before_forward"]:  # the deferred stores: vLLM calls start_load_kv before the forward pass
            assert step["sync_loads"], step


def test_round_trips_per_step_and_a_second_scheduler_loads_from_kvpool(tmp_path):
    server = start_server(tmp_path, "--num-blocks", "2048", *server_layout_args(), unix=True)
    try:
        model = write_tiny_llama(tmp_path / "model")
        first = make_scheduler(model, server.address, 1024, 6)
        steps = run(first, PROMPTS, 8)
        first.connector.shutdown()
        check_steps(steps)
        assert summary(steps)["registers"] == 2  # 12 requests, 6 a step: two lookups
        assert sum(step["copies_before_forward"] for step in steps) >= 2  # each prefill's stores, the next step
        assert not any(step["loaded_blocks"] for step in steps)
        second = make_scheduler(model, server.address, 1024, 6)
        again = run(second, PROMPTS, 8)
        second.connector.shutdown()
        check_steps(again)
        assert sum(step["loaded_blocks"] for step in again) == len(PROMPTS) * (299 // BLOCK_SIZE)
    finally:
        server.stop()


def test_requests_past_a_lookups_bounds_are_looked_up_the_next_step(tmp_path, monkeypatch):
    monkeypatch.setattr(connector_scheduler, "LOOKUP_TOKENS", 2 * 300)  # two prompts a lookup
    server = start_server(tmp_path, "--num-blocks", "2048", *server_layout_args(), unix=True)
    try:
        model = write_tiny_llama(tmp_path / "model")
        first = make_scheduler(model, server.address, 1024, 6)
        steps = run(first, PROMPTS[:6], 8)
        first.connector.shutdown()
        check_steps(steps)
        assert summary(steps)["registers"] == 3
        assert [s["registers"] for s in steps[:3]] == [1, 1, 1]  # admitted two a step
        second = make_scheduler(model, server.address, 1024, 6)
        again = run(second, PROMPTS[:6], 8)
        second.connector.shutdown()
        assert sum(step["loaded_blocks"] for step in again) == 6 * (299 // BLOCK_SIZE)
    finally:
        server.stop()


def test_a_lookup_of_several_prompts_makes_no_grpc_call_when_the_fast_path_is_open(tmp_path):
    """The step's lookups go as one register-many record over the connector's fast-path channel: no gRPC
    RegisterSequences (the client's gRPC calls counted), and a second scheduler still finds the blocks."""
    server = start_server(tmp_path, "--num-blocks", "2048", *server_layout_args(), unix=True)
    try:
        model = write_tiny_llama(tmp_path / "model")
        for again in (False, True):
            scheduler = make_scheduler(model, server.address, 1024, 6)
            client = scheduler.connector.scheduler.link.client
            client.free(client.register())  # the session and the channel open
            calls = counting_grpc(client)
            steps = run(scheduler, PROMPTS, 8)
            assert client.fast_path_open
            scheduler.connector.shutdown()
            assert summary(steps)["registers"] == 2  # two lookups of six prompts each
            assert "RegisterSequences" not in calls, calls
            loaded = sum(step["loaded_blocks"] for step in steps)
            assert loaded == (len(PROMPTS) * (299 // BLOCK_SIZE) if again else 0)
    finally:
        server.stop()


def test_finished_requests_kvpool_has_no_sequence_of_are_registered_then_stored_a_call_each(tmp_path):
    """Prompts of less than a block are never looked up; when they finish past a block, their one register goes
    in a step's call, their append in the next one's (one round trip a step still), and a second scheduler given
    those tokens (the prompt and the model's 7s) finds the block."""
    server = start_server(tmp_path, "--num-blocks", "2048", *server_layout_args(), unix=True)
    try:
        model = write_tiny_llama(tmp_path / "model")
        short = [p[:20] for p in PROMPTS[:4]]
        first = make_scheduler(model, server.address, 1024, 6)
        steps = run(first, short, 20)  # 40 tokens each at the end: one full block
        first.connector.shutdown()
        check_steps(steps)
        assert summary(steps)["registers"] == 1  # the four finished requests' sequences, in one call
        second = make_scheduler(model, server.address, 1024, 6)
        again = run(second, [p + [7] * 20 for p in short], 4)
        second.connector.shutdown()
        check_steps(again)
        assert sum(step["loaded_blocks"] for step in again) == len(short)  # a block each, from kvpool
    finally:
        server.stop()
