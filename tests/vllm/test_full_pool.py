"""A full kvpool pool under vLLM's own scheduler (in this process, no model: benchmarks/bench_vllm_connector.py's
harness): the stores that do not fit are refused by kvpool (RESOURCE_EXHAUSTED) and are misses -- every request
runs to its end, the connection stays up, kvpool is left consistent with nothing held -- and a later engine whose
stores fit stores and finds its prompts."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` installs it (CPU) and runs these")

from benchmarks.bench_vllm_connector import make_scheduler, run  # noqa: E402
from tests.conftest import start_server  # noqa: E402
from tests.vllm.tiny_model import BLOCK_SIZE, server_layout_args, write_tiny_llama  # noqa: E402

from kvpool_client import KVPoolClient  # noqa: E402

NUM_BLOCKS = 24  # three 300-token prompts (9 full blocks each) do not fit at once; two do


def test_a_full_pool_makes_stores_misses_and_the_link_stays(tmp_path):
    server = start_server(tmp_path, "--num-blocks", str(NUM_BLOCKS), *server_layout_args(), unix=True)
    try:
        model = write_tiny_llama(tmp_path / "model")
        prompts = [[(i * 7919 + j * 31) % 500 + 3 for j in range(300)] for i in range(6)]
        full = make_scheduler(model, server.address, 1024, 3)  # three a step: each step's store is 27 blocks
        steps = run(full, prompts, 8)
        link = full.connector.scheduler.link
        assert link.client is not None and link.generation == 1  # never taken down by RESOURCE_EXHAUSTED
        full.connector.shutdown()
        assert len(steps) >= 8 and not any(s["loaded_blocks"] for s in steps)
        with KVPoolClient(server.address) as client:
            stats = client.stats()
            assert stats.num_sequences == 0 and stats.num_blocks_used == 0 and client.check_invariants().ok
            seq, hit = client.register_prompt(prompts[0])
            client.free(seq)
            assert hit == 0  # refused whole, never sealed
        fits = make_scheduler(model, server.address, 1024, 1)  # one a step: 9 blocks, stored
        run(fits, prompts[:2], 8)
        fits.connector.shutdown()
        again = make_scheduler(model, server.address, 1024, 1)
        loaded = run(again, prompts[:2], 8)
        again.connector.shutdown()
        assert sum(s["loaded_blocks"] for s in loaded) == 2 * (299 // BLOCK_SIZE)
    finally:
        server.stop()
