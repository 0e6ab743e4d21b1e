"""The worker's copies in the order the deferred stores need, against a real kvpool server's pool: a step's stores
(KV an earlier step computed) are copied out of vLLM's blocks before its loads write them -- vLLM may have given
a preempted request's block to a request whose load fills it -- and before the forward pass (the scheduler sets
``has_sync_kv_loads`` on a step that stores, so vLLM calls ``start_load_kv`` first)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` installs it (CPU) and runs these")

import torch  # noqa: E402

from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_client.integrations.vllm.link import pool_id  # noqa: E402
from kvpool_client.integrations.vllm.metadata import BlockCopy, KVPoolConnectorMetadata  # noqa: E402
from kvpool_client.integrations.vllm.settings import ConnectorSettings, ModelLayout  # noqa: E402
from kvpool_client.integrations.vllm.worker import KVPoolWorker  # noqa: E402
from tests.conftest import start_server  # noqa: E402
from tests.vllm.tiny_model import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, server_layout_args  # noqa: E402

MODEL = ModelLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, "float32")


def test_a_steps_stores_are_copied_before_its_loads_overwrite_the_same_vllm_block(tmp_path):
    server = start_server(tmp_path, "--num-blocks", "64", *server_layout_args(), unix=True)
    worker = KVPoolWorker(ConnectorSettings.from_extra_config({"target": server.address}), MODEL)
    try:
        torch.manual_seed(0)
        caches = {f"model.layers.{i}.self_attn.attn": torch.randn(8, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
                  for i in range(NUM_LAYERS)}
        before = {name: cache.clone() for name, cache in caches.items()}
        worker.register_kv_caches(caches)
        with KVPoolClient(server.address, session=False) as probe:
            pool = pool_id(probe.describe_pool())
        # block 3 of vLLM: stored into pool block 5 (its KV of the last step), then loaded from pool block 9
        worker.start_load_kv(KVPoolConnectorMetadata(pool_id=pool, saves=[BlockCopy("a", (9,), (3,))]))
        loaded_from_9 = {name: cache[3].clone() for name, cache in caches.items()}  # what pool block 9 now holds
        for cache in caches.values():
            cache[3].normal_()  # the step's forward pass writes block 3 (a preempted request's, reused)
        meta = KVPoolConnectorMetadata(pool_id=pool, saves=[BlockCopy("b", (5,), (3,))],
                                       loads=[BlockCopy("c", (9,), (3,))])
        stored = {name: cache[3].clone() for name, cache in caches.items()}
        worker.start_load_kv(meta)
        assert worker.get_block_ids_with_load_errors() == set() and worker.worker_meta() is None
        for name, cache in caches.items():
            assert torch.equal(cache[3], loaded_from_9[name]), "the load did not land"
        # pool block 5 holds what block 3 held before the load: read it back into block 4
        worker.start_load_kv(KVPoolConnectorMetadata(pool_id=pool, loads=[BlockCopy("d", (5,), (4,))]))
        for name, cache in caches.items():
            assert torch.equal(cache[4], stored[name]), "the store copied the loaded KV, not the computed one"
            assert not torch.equal(stored[name], loaded_from_9[name]) and torch.equal(cache[0], before[name][0])
        assert worker.blocks_stored == 2 and worker.blocks_loaded == 2
    finally:
        worker.close()
        server.stop()
