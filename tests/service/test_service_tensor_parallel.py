"""The service over a tensor-parallel pool (--tensor-parallel N, host backend): the same plans and the same KV as
over one pool -- the control path does not depend on N."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool_server.config import ServerConfig
from kvpool_server.device.sharded_pool import ShardedPool
from kvpool_server.service.build import build_service
from kvpool_server.service.scope import CallScope


def script(n: int) -> tuple[list[tuple[np.ndarray, ...]], bytes]:
    """One scripted run (register, prefill, fork, decode with copies, free, reuse): every append's plan, and the
    KV of the last sequence read back through the service."""
    config = ServerConfig(backend="host", num_blocks=64, block_size=4, num_layers=2, num_kv_heads=4, head_dim=4,
                          dtype="float32", max_seq_len=256, tensor_parallel=n)
    service, admission = build_service(config)
    scope = CallScope(admission, None, None)
    pool = service.guard.pool
    assert isinstance(pool, ShardedPool) == (n > 1) and pool.tensor_parallel == n
    plans = []
    try:
        def call(rpc: str, method, *args, **kwargs):
            with scope.call(rpc) as c:
                return method(c, *args, **kwargs)

        a = call("RegisterSequence", service.register).seq_id
        plans.append(call("AppendToken", service.append, [a], [10]))
        kv = np.arange(10 * 2 * 2 * 4 * 4, dtype=np.float32).reshape(10, 2, 2, 4, 4)
        call("WriteKV", service.write_kv, a, 0, kv.tobytes())
        children = call("Fork", service.fork, a, 3)
        plans.append(call("AppendToken", service.append, [a, *children], [1, 1, 1, 1]))
        for _ in range(5):
            plans.append(call("AppendToken", service.append, [a, *children]))
        call("Free", service.free, [a, children[0]])
        b = call("RegisterSequence", service.register).seq_id
        plans.append(call("AppendToken", service.append, [b], [12]))
        got = call("ReadKV", service.read_kv, children[1], 0, 10)
        assert isinstance(got, bytes) and got == kv.tobytes()  # the child reads the parent's KV, whole tokens
        return [tuple(np.asarray(x).copy() for x in plan) for plan in plans], got
    finally:
        pool.close()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_plans_and_kv_equal_one_pool(n: int) -> None:
    one_plans, one_kv = script(1)
    plans, kv = script(n)
    assert len(plans) == len(one_plans)
    for plan, expected in zip(plans, one_plans):
        for got, want in zip(plan, expected):
            assert np.array_equal(got, want)
    assert kv == one_kv
    assert sum(len(p[2]) for p in plans) > 0 and sum(len(p[3]) for p in plans) > 0  # copies and clearing happened
