"""The 256-sequence decode step of the core alone: one ``manager.append(ids)`` (or, on code before the one-append
refactor, ``append_batch``) of one token each, best of 7 x 2,000 steps, in microseconds. Run it on two trees to
compare them in one session (docs/results.md)::

    git archive a532fb2 server client | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/server:/tmp/old/client .venv/bin/python benchmarks/decode_step.py      # before
    .venv/bin/python benchmarks/decode_step.py                                                  # now
"""

from __future__ import annotations

import time

import numpy as np

from kvpool_server.core import KVCacheManager


def main() -> None:
    manager = KVCacheManager(num_blocks=65536, block_size=16, max_seq_len=4096, max_num_seqs=4096)
    old = hasattr(manager, "append_batch")  # the code before the one-append refactor
    step = manager.append_batch if old else manager.append

    def fresh_batch() -> np.ndarray:
        ids = np.array([manager.register() for _ in range(256)], dtype=np.uint64)
        for seq_id in ids.tolist():
            step([seq_id], 20)  # a prompt of 20 tokens each
        return ids

    ids = fresh_batch()
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(2000):
            step(ids)
        best = min(best, (time.perf_counter() - start) / 2000)
        manager.free(ids.tolist())
        ids = fresh_batch()
    print(f"{best * 1e6:.2f} us per 256-sequence decode step")


if __name__ == "__main__":
    main()
