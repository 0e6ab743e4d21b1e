"""Worst-case time one call holds the servicer's lock, per kind of call, at the largest request the server accepts
(docs/api.md, "How long one call holds the lock"). In process, the core and the host pool; the issue's big layout:
2**20 blocks of 16 tokens (head_dim 1, float16), 4096 sequences. Prints milliseconds, best of 3.

Then the Fork and Free RPCs through the service (``build_service``, the guard's lock recorded): a sequence of 2,048
and of 32,768 tokens (with token ids, tracked, or without) forked into 4,095 children, then the family of 4,096
freed in one call -- the longest lock hold of each, and, for the Free, how many holds and its whole time. It runs
on trees before the chunked Free too (their Free is one hold), so two trees compare in one session::

    git archive 78bdee8 server common | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before/server:/tmp/before/common .venv/bin/python scripts/lock_hold.py --rpcs
    .venv/bin/python scripts/lock_hold.py [--rpcs]
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from kvpool.layout import KVLayout
from kvpool_server.core import KVCacheManager
from kvpool_server.device import create_pool
from kvpool_server.service.invariant_checks import InvariantChecks, copy_state
from kvpool_server.service.kv_copies import CHUNK_BYTES
from kvpool_server.service.kvpool import DEFAULT_MAX_TOKENS_PER_CALL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.service.recording_lock import RecordingLock  # noqa: E402


def timed(fn, repeat: int = 3) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def fork_and_free_rpcs() -> None:
    """Fork 4,095 children, Free the 4,096: the longest lock hold of each RPC through the service."""
    from kvpool_server.config import ServerConfig
    from kvpool_server.service.build import build_service
    from kvpool_server.service.answers import Offload
    from kvpool_server.service.scope import CallScope

    config = ServerConfig(backend="host", num_blocks=1 << 20, block_size=16, num_layers=1, num_kv_heads=1, head_dim=1,
                          dtype="float16", max_num_seqs=4096, max_batch=4096)
    service, admission = build_service(config)
    lock = service.guard.lock = RecordingLock()  # type: ignore[assignment]
    scope = CallScope(admission, None, None)

    async def family(length: int, tracked: bool) -> str:
        with scope.call("RegisterSequence") as call:
            parent = service.register(call).seq_id
        with scope.call("AppendToken") as call:
            service.append(call, [parent], [length], list(range(length)) if tracked else [])
        lock.holds.clear()
        with scope.call("Fork") as call:
            children = service.fork(call, parent, 4095)
        fork_hold = max(lock.holds)
        lock.holds.clear()
        started = time.perf_counter()
        with scope.call("Free") as call:
            answer = service.free(call, [parent, *children])
        if isinstance(answer, Offload):
            answer = await asyncio.get_running_loop().run_in_executor(None, answer.work)
        took = time.perf_counter() - started
        if "-v" in sys.argv:
            print("   holds (ms):", [round(h * 1e3, 2) for h in lock.holds])
        return (f"{length:>6} tokens{' tracked' if tracked else '        '}: Fork of 4,095 children holds "
                f"{fork_hold * 1e3:6.2f} ms; Free of the 4,096 ({answer} blocks, {4096 * -(-length // 16):,} "
                f"references): longest hold {max(lock.holds) * 1e3:6.2f} ms of {len(lock.holds)}, "
                f"{took * 1e3:.1f} ms in all")

    async def all_families() -> None:
        for length in (2048, 32768):
            for tracked in (False, True):
                print(await family(length, tracked))

    try:
        asyncio.run(all_families())
    finally:
        service.guard.pool.close()


def main() -> None:
    if "--rpcs" in sys.argv:
        fork_and_free_rpcs()
        return
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
    fork_and_free_rpcs()


if __name__ == "__main__":
    main()
