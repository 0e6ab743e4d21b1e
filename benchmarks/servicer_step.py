"""The in-process cost of one 256-sequence AppendToken through the servicer: parse the request's bytes, the
servicer's method (session gate, lock, the core's append, events check, response), serialize the reply -- what the
server does per decode step besides gRPC itself. Best of 7 x 2,000 steps, in microseconds. Run it on two trees to
compare them in one session (docs/service-bench.md)::

    git archive 8579de5 server common | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/server:/tmp/old/common taskset -c 1 .venv/bin/python benchmarks/servicer_step.py  # before
    taskset -c 1 .venv/bin/python benchmarks/servicer_step.py                                             # now
"""

from __future__ import annotations

import time
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.layout import KVLayout
from kvpool_server.core import KVCacheManager
from kvpool_server.device import create_pool
from kvpool_server.service.kvpool import KVPoolServicer

layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=16, dtype="float32")
pool = create_pool(layout, backend="host", num_blocks=65536)
manager = KVCacheManager(num_blocks=65536, block_size=16, max_seq_len=8192, max_num_seqs=4096)
servicer = KVPoolServicer(manager, pool, max_batch=4096, max_message_bytes=64 << 20)
ids = [servicer.RegisterSequence(pb.RegisterSequenceRequest(), None).seq_id for _ in range(256)]
raw = pb.AppendTokenRequest(seq_ids=ids).SerializeToString()
best = []
for _ in range(7):
    n = 2000
    t0 = time.perf_counter()
    for _step in range(n):
        servicer.AppendToken(pb.AppendTokenRequest.FromString(raw), None).SerializeToString()
    best.append((time.perf_counter() - t0) / n * 1e6)
    servicer.Free(pb.FreeRequest(seq_ids=ids), None)
    ids = [servicer.RegisterSequence(pb.RegisterSequenceRequest(), None).seq_id for _ in range(256)]
    raw = pb.AppendTokenRequest(seq_ids=ids).SerializeToString()
print(f"{min(best):.1f} us per 256-sequence AppendToken through the servicer (best of 7 x 2000)")
pool.close()
