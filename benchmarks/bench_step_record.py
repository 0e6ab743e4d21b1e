"""A scheduler's step -- an append that stores 16 prompts (16 x 511 tokens, their ids) and a lookup of 16 new
512-token prompts -- as one step record (``KVPoolClient.step``) against the same two calls as two records
(``append``, then ``register_prompts``), alternating, one local kvpool-server (unix socket, fast path, block
size 32). Prints each one's median round trip.

    .venv/bin/python benchmarks/bench_step_record.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    from kvpool_client import KVPoolClient
    from tests.conftest import start_server

    server = start_server(Path(tempfile.mkdtemp(prefix="bench-step-")), "--num-blocks", "65536", "--head-dim",
                          "8", "--block-size", "32", unix=True)
    times: dict[str, list[float]] = {"two records": [], "one step record": []}
    try:
        with KVPoolClient(server.address) as client:
            rng = np.random.default_rng(0)
            for i in range(args.rounds):
                for mode in sorted(times, reverse=bool(i % 2)):
                    stored = [rng.integers(3, 50_000, 512).astype(np.uint32) for _ in range(16)]
                    seqs = [r.seq_id for r in client.register_prompts([p[:1] for p in stored])]
                    tokens = np.concatenate([p[1:] for p in stored])
                    new = [rng.integers(3, 50_000, 512).astype(np.uint32) for _ in range(16)]
                    start = time.perf_counter()
                    if mode == "two records":
                        client.append(seqs, [511] * 16, token_ids=tokens)
                        found = client.register_prompts(new)
                    else:
                        found = client.step(append=(seqs, [511] * 16, tokens), register=(new, [])).registered
                    times[mode].append(time.perf_counter() - start)
                    client.free(seqs + [r.seq_id for r in found])
            assert client.fast_path_open
    finally:
        server.stop()
    for mode, seconds in times.items():
        print(f"{mode}: median {statistics.median(seconds) * 1e3:.2f} ms over {len(seconds)}")


if __name__ == "__main__":
    main()
