"""The worker's store copy (vLLM's CPU KV cache -> kvpool's host pool), the way it is made and the way it was.

    .venv-vllm/bin/python benchmarks/bench_vllm_store_copy.py [--blocks 512] [--repeat 10]

The tiny model's layout (2 layers, 2 KV heads of 32, block size 32, float32); ``--blocks`` blocks stored, timed
``--repeat`` times, alternating: "staged" (every layer's K and V gathered, stacked into one staging tensor, then
scattered: the worker before) and "direct" (each layer's K and V gathered and scattered straight into the pool:
``KVPoolWorker._copy``). Every run's bytes are compared with vLLM's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
from kvpool_client.integrations.vllm.worker import kv_views  # noqa: E402

LAYERS, BLOCK, HEADS, HEAD = 2, 32, 2, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    caches = [torch.randn(4 * args.blocks, HEADS, BLOCK, 2 * HEAD) for _ in range(LAYERS)]  # vLLM 0.32's CPU shape
    layers = [kv_views(c, BLOCK) for c in caches]
    pool = torch.zeros(4 * args.blocks, LAYERS, 2, BLOCK, HEADS, HEAD)
    vllm_ids = torch.randperm(4 * args.blocks)[: args.blocks]
    pool_ids = torch.randperm(4 * args.blocks)[: args.blocks]

    def staged() -> None:
        pool[pool_ids] = torch.stack([torch.stack((k[vllm_ids], v[vllm_ids]), dim=1) for k, v in layers], dim=1)

    def direct() -> None:
        for layer, (k, v) in enumerate(layers):
            pool[:, layer, 0].index_copy_(0, pool_ids, k.index_select(0, vllm_ids))
            pool[:, layer, 1].index_copy_(0, pool_ids, v.index_select(0, vllm_ids))

    times: dict[str, list[float]] = {"staged": [], "direct": []}
    for _ in range(args.repeat):
        for name, copy in (("staged", staged), ("direct", direct)):
            pool.zero_()
            start = time.perf_counter()
            copy()
            times[name].append(time.perf_counter() - start)
            assert all(torch.equal(pool[pool_ids, i, 0], k[vllm_ids]) and torch.equal(pool[pool_ids, i, 1], v[vllm_ids])
                       for i, (k, v) in enumerate(layers)), name
    mib = args.blocks * LAYERS * 2 * BLOCK * HEADS * HEAD * 4 / 2**20
    result = {name: {"median_ms": statistics.median(t) * 1e3, "MiB": mib} for name, t in times.items()}
    result["direct_over_staged"] = result["direct"]["median_ms"] / result["staged"]["median_ms"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
