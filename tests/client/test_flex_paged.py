"""FlexAttention reading a pool's K/V where they lie (``kernels/flex_paged.py``), on the host pool of a real server in
both orders, against the float64 reference: decode with GQA, and causal prefill. Runs where PyTorch has FlexAttention
(``kvpool[torch]``); the GPU case is in test_kernels_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.nn.attention.flex_attention")

from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_client.kernels import reference, torch_views  # noqa: E402
from kvpool_client.kernels.flex_paged import flex_paged_attention, token_rows  # noqa: E402


@pytest.mark.parametrize("kv_layout,kv_tile", [("block-major", 128), ("layer-major", 128), ("layer-major", 16)])
def test_flex_attention_over_the_host_pool_matches_the_reference(server_factory, kv_layout, kv_tile):
    server = server_factory("--backend", "host", "--num-layers", "3", "--num-kv-heads", "2", "--head-dim", "16",
                            "--block-size", "16", "--dtype", "float32", "--num-blocks", "40", "--kv-layout", kv_layout)
    rng = np.random.default_rng(1)
    with KVPoolClient(server.address) as client, client.attach() as pool:
        pool.blocks[...] = rng.standard_normal(pool.blocks.shape).astype(np.float32)
        k, v = torch_views.layer_kv(pool, 1)
        rows, per_block = token_rows(k)
        assert per_block == (16 if kv_layout == "layer-major" else 3 * 2 * 16)
        assert rows.data_ptr() == k.data_ptr()  # a view of the pool, not a copy
        lens = np.array([1, 17, 40, 100])
        tables = np.stack([rng.permutation(40)[:7] for _ in lens])
        q = rng.standard_normal((4, 8, 16)).astype(np.float32)
        out = flex_paged_attention(torch.from_numpy(q), k, v, torch.from_numpy(tables), torch.from_numpy(lens),
                                   scale=0.3, kv_tile=kv_tile)
        ref = reference.paged_decode_attention(q, k.numpy(), v.numpy(), tables, lens, scale=0.3)
        np.testing.assert_allclose(out.numpy(), ref, atol=1e-5)
        qp = rng.standard_normal((2, 5, 8, 16)).astype(np.float32)  # the last 5 tokens of sequences 2 and 3
        out = flex_paged_attention(torch.from_numpy(qp), k, v, torch.from_numpy(tables[2:]),
                                   torch.from_numpy(lens[2:]), scale=0.3, kv_tile=kv_tile)
        for i, b in enumerate([2, 3]):
            ctx_k = reference.gather_context(k.numpy(), tables[b], lens[b])
            ctx_v = reference.gather_context(v.numpy(), tables[b], lens[b])
            np.testing.assert_allclose(out[i].numpy(), reference.dense_attention(qp[i], ctx_k, ctx_v, 0.3, causal=True),
                                       atol=1e-5)
