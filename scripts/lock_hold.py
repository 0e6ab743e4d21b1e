"""Worst-case time one call holds the servicer's lock, per kind of call, at the largest request the server accepts
(docs/api.md, "How long one call holds the lock"). In process, the core and the host pool; the issue's big layout:
2**20 blocks of 16 tokens (head_dim 1, float16), 4096 sequences. Prints milliseconds, best of 3.

    .venv/bin/python scripts/lock_hold.py
"""

from __future__ import annotations

import time

from kvpool.layout import KVLayout
from kvpool_server.core import KVCacheManager
from kvpool_server.device import create_pool
from kvpool_server.service.invariant_checks import InvariantChecks, copy_state
from kvpool_server.service.kv_copies import CHUNK_BYTES
from kvpool_server.service.kvpool import DEFAULT_MAX_TOKENS_PER_CALL


def timed(fn, repeat: int = 3) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    layout = KVLayout(1, 1, 1, 16, "float16")
    m = KVCacheManager(1 << 20, 16, max_num_seqs=4096)
    print(f"layout: 2**20 blocks, max_seq_len {m.max_seq_len}, --max-tokens-per-call {DEFAULT_MAX_TOKENS_PER_CALL}")
    n = DEFAULT_MAX_TOKENS_PER_CALL
    for seqs, count in ((4, n // 4), (4096, n // 4096)):
        def append(seqs: int = seqs, count: int = count) -> None:
            ids = [m.register() for _ in range(seqs)]
            t0 = time.perf_counter()
            m.append(ids, count)
            append.took = time.perf_counter() - t0  # type: ignore[attr-defined]
            m.free(ids)
        worst = 0.0
        for _ in range(3):
            append()
            worst = max(worst, append.took)  # type: ignore[attr-defined]
        print(f"append {seqs} x {count} tokens: {worst * 1e3:.2f} ms")
    parent = m.register()
    m.append([parent], m.max_seq_len)
    children: list[int] = []

    def fork() -> None:
        children.extend(m.fork(parent, 4095))

    print(f"fork of a {m.max_seq_len}-token sequence into 4095 children: {timed(fork, 1):.2f} ms")
    print(f"free of 4096 sequences ({m.stats().num_blocks_used} blocks): {timed(lambda: m.free([parent, *children]), 1):.2f} ms")
    ids = [m.register() for _ in range(2048)]  # half the pool in use
    for i in range(0, 2048, 16):
        m.append(ids[i:i + 16], 4096)
    checks = InvariantChecks(m)
    print(f"CheckInvariants' copy under the lock ({m.stats().num_blocks_used} blocks used): "
          f"{timed(lambda: copy_state(m, checks._snapshot)):.2f} ms (the check itself, off the lock: "
          f"{timed(m.check_invariants, 1):.0f} ms)")
    print(f"stats: {timed(m.stats):.2f} ms")
    with create_pool(layout, backend="host", num_blocks=1 << 16) as pool:
        import numpy as np

        chunk = CHUNK_BYTES // layout.token_bytes
        slots = np.arange(chunk, dtype=np.int64) * 3 % pool.num_slots
        data = np.zeros((chunk, *layout.token_shape), dtype=layout.storage_dtype)
        print(f"one 1 MiB WriteKV chunk ({chunk} tokens of {layout.token_bytes} B), the pool's lock: "
              f"{timed(lambda: pool.write_slots(slots, data)):.2f} ms")
    seed = KVLayout()
    with create_pool(seed, backend="host", num_blocks=8192) as pool:
        import numpy as np

        chunk = CHUNK_BYTES // seed.token_bytes
        slots = np.arange(chunk, dtype=np.int64)
        data = np.zeros((chunk, *seed.token_shape), dtype=seed.storage_dtype)
        print(f"one 1 MiB WriteKV chunk of the seed layout ({chunk} tokens of {seed.token_bytes} B): "
              f"{timed(lambda: pool.write_slots(slots, data)):.2f} ms")


if __name__ == "__main__":
    main()
