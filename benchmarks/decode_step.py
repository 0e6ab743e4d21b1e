"""The 256-sequence decode step of the core alone: one ``manager.append(ids)`` (or, on code before the one-append
refactor, ``append_batch``) of one token each, best of 7 x 2,000 steps, in microseconds. Run it on two trees to
compare them in one session (docs/results.md)::

    git archive a532fb2 server client | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/server:/tmp/old/client .venv/bin/python benchmarks/decode_step.py      # before
    .venv/bin/python benchmarks/decode_step.py                                                  # now

``--tenancy``: the same step as one tenant of a manager with tenancy on (a server with ``--auth-tokens``), whose
ids resolve in the tenant's namespace (docs/security.md).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from kvpool_server.core import KVCacheManager


def main() -> None:
    tenancy = "--tenancy" in sys.argv[1:]
    manager = KVCacheManager(num_blocks=65536, block_size=16, max_seq_len=4096, max_num_seqs=4096, tenancy=tenancy)
    old = hasattr(manager, "append_batch")  # the code before the one-append refactor
    tenant = manager.tenants.tenant_id("t") if tenancy else None
    step = manager.append_batch if old else manager.append if tenant is None else (
        lambda ids, n=1: manager.append(ids, n, tenant))

    def fresh_batch() -> np.ndarray:
        ids = np.array([manager.register(tenant=tenant) for _ in range(256)], dtype=np.uint64)
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
        manager.free(ids.tolist(), tenant)
        ids = fresh_batch()
    print(f"{best * 1e6:.2f} us per 256-sequence decode step{' (tenancy on)' if tenancy else ''}")


if __name__ == "__main__":
    main()
