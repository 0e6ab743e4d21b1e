"""bench_ttft.py's host-tier variant (``--tier``): the prefix served from kvpool's host tier, restored into the pool
before the register replies, against the same prompt recomputed.

A server whose pool holds one and a half prompts (``per_prompt * 1.5 + 2`` blocks) and a host tier of four
prompts. The writer process writes and seals the prefix, as in bench_ttft.py. Then, for each of ``--repeats``
rounds, the reader engine first prefills two *filler* prompts (random tokens, their own cache key, a prompt's
length each): together they need more than the pool, so every cached block of the prefix is evicted into the
tier. Then it times the *tier hit* -- ``prefix + suffix_i``, whose 256 prefix blocks the register restores from
the tier into the pool -- and the *recompute* of the same prompt under an unused key. The rounds' Stats deltas say how many
blocks were restored (a round that restored fewer than the prefix's blocks is reported, not hidden).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import bench_ttft
from kvpool_client import KVPoolClient
from kvpool_client.integrations.engine import DecodeEngine

WAIT_READY_S = 120.0


def wait_tier_ready(client: KVPoolClient) -> None:
    deadline = time.monotonic() + WAIT_READY_S
    while time.monotonic() < deadline:
        tier = client.stats().host_tier
        if tier is not None and tier.bytes_total and tier.bytes_ready == tier.bytes_total:
            return
        time.sleep(0.2)
    raise RuntimeError("the host tier was not ready in time")


def measure(args: argparse.Namespace, model, layout, prefix: list[int], suffixes: list[list[int]],
            start_server) -> dict:
    kwargs = bench_ttft.engine_kwargs(args)
    per_prompt = -(-kwargs["max_model_len"] // bench_ttft.BLOCK_SIZE)
    num_blocks = per_prompt + per_prompt // 2 + 2  # two fillers (one prompt each) evict every block of the prefix
    tier_bytes = 4 * per_prompt * layout.block_bytes
    rng = np.random.default_rng(bench_ttft.SEED + 1)
    fill_len = len(prefix) + len(suffixes[0])
    proc, address = start_server(args, layout, num_blocks, ("--host-tier-bytes", str(tier_bytes)))
    try:
        bench_ttft.run_writer(args, address)
        with KVPoolClient(address) as client:
            wait_tier_ready(client)
            engine = DecodeEngine.on_pool(model, client, **kwargs)

            def filler(i: int) -> None:
                bench_ttft.first_token(engine, rng.integers(0, args.vocab, fill_len).tolist(),
                                       f"filler-{i}".encode(), args)

            filler(-2)
            filler(-1)
            bench_ttft.first_token(engine, prefix + suffixes[1], b"", args)  # warm: kernels, graphs, a restore
            hits, misses, restored, cached, same = [], [], [], [], True
            for i, suffix in enumerate(suffixes[2:]):
                filler(2 * i)
                filler(2 * i + 1)
                before = client.stats().host_tier
                hit = bench_ttft.first_token(engine, prefix + suffix, b"", args)
                after = client.stats().host_tier
                miss = bench_ttft.first_token(engine, prefix + suffix, f"tier-recompute-{i}".encode(), args)
                assert before is not None and after is not None
                restored.append(after.num_blocks_restored - before.num_blocks_restored)
                if args.verbose_tier:
                    print(f"round {i}: cached {hit[1]}, restored {restored[-1]}, hit {hit[0] * 1e3:.1f} ms (register {hit[4] * 1e3:.1f}), miss {miss[0] * 1e3:.1f} ms (register {miss[4] * 1e3:.1f})", flush=True)
                hits.append(hit[0])
                misses.append(miss[0])
                cached.append(hit[1])
                same &= hit[3] == miss[3]
            engine.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"hit_s": statistics.median(hits), "recompute_s": statistics.median(misses), "hits_s": hits,
            "recomputes_s": misses, "cached": min(cached), "restored_blocks": restored,
            "prompt": len(prefix) + len(suffixes[0]), "tokens_identical": same, "pool_blocks": num_blocks,
            "tier_bytes": tier_bytes}


def report(r: dict) -> None:
    print(f"host tier : TTFT hit {r['hit_s'] * 1e3:8.2f} ms ({r['cached']}/{r['prompt']} cached, blocks restored "
          f"per hit {min(r['restored_blocks'])}-{max(r['restored_blocks'])}), recompute {r['recompute_s'] * 1e3:8.2f} "
          f"ms, {r['recompute_s'] / r['hit_s']:.1f}x; tokens identical: {'yes' if r['tokens_identical'] else 'no'}",
          flush=True)


if __name__ == "__main__":
    sys.exit("run it through bench_ttft.py --tier")
