"""The 256-sequence decode step of the core alone: one ``manager.append(ids)`` (or, on code before the one-append
refactor, ``append_batch``) of one token each, best of 7 x 2,000 steps, in microseconds. Run it on two trees to
compare them in one session (docs/results.md)::

    git archive a532fb2 server client | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/server:/tmp/old/client .venv/bin/python benchmarks/decode_step.py      # before
    .venv/bin/python benchmarks/decode_step.py                                                  # now
"""

import sys, time, numpy as np
from kvpool_server.core import KVCacheManager
m = KVCacheManager(num_blocks=65536, block_size=16, max_seq_len=4096, max_num_seqs=4096)
ids = np.array([m.register() for _ in range(256)], dtype=np.uint64)
step = getattr(m, "append_batch", None) or m.append
for s in ids.tolist(): step([s], 20) if hasattr(m, "append_batch") else m.append(s, 20)
best = 1e9
for rep in range(7):
    t0 = time.perf_counter()
    for _ in range(2000):
        step(ids)
    best = min(best, (time.perf_counter() - t0) / 2000)
    # reset lengths: free and re-register
    m.free(ids.tolist()); ids = np.array([m.register() for _ in range(256)], dtype=np.uint64)
    for s in ids.tolist(): step([s], 20) if hasattr(m, "append_batch") else m.append(s, 20)
print(f"{best*1e6:.2f}")
