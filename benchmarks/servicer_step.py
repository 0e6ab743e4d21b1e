"""The in-process cost of one 256-sequence AppendToken through the server's own code: parse the request's bytes, the
call scope (admission, metrics off, no auth), the service (fencing, the lock, the core's append, events check), the
response, serialized -- what the server does per decode step besides gRPC itself. Best of 7 x 2,000 steps, in
microseconds. It runs on the current tree (the transport-neutral service layer) and on trees before it (the
``KVPoolServicer`` with protobuf methods), so two trees compare in one session (docs/results.md)::

    git archive 007e014 server common | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before/server:/tmp/before/common taskset -c 1 .venv/bin/python benchmarks/servicer_step.py
    taskset -c 1 .venv/bin/python benchmarks/servicer_step.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.config import ServerConfig

STEPS, ROUNDS, BATCH = 2000, 7, 256


BACKEND = "host"


def current_tree() -> tuple[Callable[[bytes], bytes], Callable[[], list[int]], Callable[[list[int]], None], object]:
    from kvpool_server.grpc_api.methods import RPCS
    from kvpool_server.service.build import build_service
    from kvpool_server.service.scope import CallScope

    config = ServerConfig(backend=BACKEND, num_blocks=65536, block_size=16, num_layers=1, num_kv_heads=1,
                          head_dim=1, dtype="float32", max_seq_len=8192, max_num_seqs=4096, max_batch=4096)
    service, admission = build_service(config)
    scope = CallScope(admission, None, None)
    append = RPCS["AppendToken"]

    def step(raw: bytes) -> bytes:
        with scope.call("AppendToken") as call:
            return append.encode(service, append.invoke(service, call, pb.AppendTokenRequest.FromString(raw))) \
                .SerializeToString()

    def register() -> list[int]:
        with scope.call("RegisterSequence") as call:
            return [service.register(call).seq_id for _ in range(BATCH)]

    def free(ids: list[int]) -> None:
        with scope.call("Free") as call:
            service.free(call, ids)

    return step, register, free, service.guard.pool


def tree_before() -> tuple[Callable[[bytes], bytes], Callable[[], list[int]], Callable[[list[int]], None], object]:
    from kvpool.layout import KVLayout
    from kvpool_server.core import KVCacheManager
    from kvpool_server.device import create_pool
    from kvpool_server.drain import Drain  # type: ignore[import-not-found]
    from kvpool_server.service import KVPoolServicer  # type: ignore[attr-defined]

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=16, dtype="float32")
    pool = create_pool(layout, backend=BACKEND, num_blocks=65536)
    manager = KVCacheManager(num_blocks=65536, block_size=16, max_seq_len=8192, max_num_seqs=4096)
    servicer = KVPoolServicer(manager, pool, max_batch=4096, max_message_bytes=64 << 20)
    drain = Drain()

    def step(raw: bytes) -> bytes:  # what its unary handler did around the servicer: admit, parse, call, release
        drain.admit()
        try:
            return servicer.AppendToken(pb.AppendTokenRequest.FromString(raw), None).SerializeToString()
        finally:
            drain.release()

    return (step,
            lambda: [servicer.RegisterSequence(pb.RegisterSequenceRequest(), None).seq_id for _ in range(BATCH)],
            lambda ids: servicer.Free(pb.FreeRequest(seq_ids=ids), None), pool)


def main() -> None:
    global BACKEND
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("host", "gpu"), default="host",
                        help="the pool's memory (gpu: the blocks that change hands are cleared on the device)")
    BACKEND = parser.parse_args().backend
    try:
        step, register, free, pool = current_tree()
        which = "service layer"
    except ImportError:
        step, register, free, pool = tree_before()
        which = "KVPoolServicer (before the service layer)"
    print(f"{measure(step, register, free) * 1e6:.1f} us per {BATCH}-sequence AppendToken through the {which}, "
          f"{BACKEND} pool (best of {ROUNDS} x {STEPS})")
    if hasattr(pool, "zero_blocks"):  # the same step without clearing the blocks that change hands: what it costs
        pool.zero_blocks = lambda block_ids: None  # type: ignore[attr-defined]  (a measurement, never a setting)
        print(f"{measure(step, register, free) * 1e6:.1f} us per {BATCH}-sequence AppendToken through the {which}, "
              f"{BACKEND} pool, blocks not cleared (measurement only)")
    pool.close()  # type: ignore[attr-defined]


def measure(step: Callable[[bytes], bytes], register: Callable[[], list[int]],
            free: Callable[[list[int]], None]) -> float:
    """Best seconds per step over ROUNDS rounds of STEPS steps (each round a fresh batch of BATCH sequences)."""
    best = float("inf")
    for _ in range(ROUNDS):
        ids = register()
        raw = pb.AppendTokenRequest(seq_ids=ids).SerializeToString()
        started = time.perf_counter()
        for _step in range(STEPS):
            step(raw)
        best = min(best, (time.perf_counter() - started) / STEPS)
        free(ids)
    return best


if __name__ == "__main__":
    main()
