"""The 256-sequence decode step over the fast path's records, in one process and without the wake: where its time
goes, by the phase of the step. Each step is the client's record (``fastpath_records.append_writer``), the
server's ``serve_record`` (scope, service, guard, core, reply) and the client's read of the reply, on one mapped
segment; the core alone (``manager.append`` under the lock) beside it. Run it on two trees to compare them::

    git archive OLD server client common | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/server:/tmp/old/client:/tmp/old/common .venv/bin/python benchmarks/fastpath_step_phases.py
    .venv/bin/python benchmarks/fastpath_step_phases.py

With token ids, sequences that move in lockstep (all registered empty, as ``bench_service.py``'s fast kinds) fill
a block each one step in 16 ("fill": 256 blocks hashed) and seal them the next ("seal": 256 cache inserts and
BlockStored events; that step also opens a new block for every sequence -- 256 allocated and zeroed -- which is
the "seal" column without token ids); the other steps are "quiet". "Staggered": the sequences start at lengths 1..16, so that
every step fills and seals ~16 blocks. Medians of 100 cycles of 16 steps (microseconds); pin it (``taskset``).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable

import numpy as np

from kvpool import fastpath as fp
from kvpool_client import fastpath_records as ops
from kvpool_client.fast_args import append_args, uint32_tokens
from kvpool_server.config import ServerConfig
from kvpool_server.fastpath.records import ChannelHeaders, serve_record
from kvpool_server.service.build import build_service
from kvpool_server.service.scope import CallScope

NUM_SEQS, BLOCK, CYCLES, GENERATION, AREA = 256, 16, 100, 7, 1 << 20

service, admission = build_service(ServerConfig(backend="host", head_dim=1, num_blocks=1 << 19, max_seq_len=8192))
scope = CallScope(admission, None, None)
manager = service.guard.manager
with scope.call("OpenSession") as opening:
    SESSION = service.sessions.open(opening).session_id
views = fp.Views(mmap.mmap(-1, fp.segment_bytes(AREA)), AREA)
headers = ChannelHeaders(None)
tokens = np.random.default_rng(0).integers(0, 2**31, size=(4096, NUM_SEQS), dtype=np.uint32)  # new blocks each step
state = {"seq": 0, "step": 0}


def next_tokens(with_ids: bool) -> np.ndarray | None:
    state["step"] += 1
    return tokens[state["step"] % len(tokens)] if with_ids else None


def record_step(ids: list[int], with_ids: bool) -> None:
    args = append_args(ids, 1)
    assert args is not None
    toks = next_tokens(with_ids)
    ops.append_writer(GENERATION, args[1], args[3], None if toks is None else uint32_tokens(toks), 0)(views)
    state["seq"] += 1
    views.req[fp.REQ_SEQ] = state["seq"]
    serve_record(service, scope, views, headers, SESSION, GENERATION, state["seq"])
    assert views.rep[fp.REP_CODE] == 0, "the step failed"
    ops.append_reader(args[0], args[2])(views)


def core_step(ids: list[int], with_ids: bool) -> None:
    toks = next_tokens(with_ids)
    with service.guard.lock:
        manager.append(np.array(ids, dtype=np.uint64), 1, None, toks)


def timed(step: Callable[[list[int], bool], None], with_ids: bool, stagger: bool) -> np.ndarray:
    """Microseconds of each of CYCLES x BLOCK steps (after one warm-up cycle) on fresh sequences."""
    with scope.call("RegisterSequence") as call:
        ids = [service.register(call, None, SESSION).seq_id for _ in range(NUM_SEQS)]
    if stagger:
        counts = np.arange(NUM_SEQS) % BLOCK + 1
        with scope.call("AppendToken") as call:
            service.append(call, ids, counts.tolist(), np.arange(int(counts.sum()), dtype=np.uint32), SESSION)
    for _ in range(BLOCK):
        step(ids, with_ids)
    times = []
    for _ in range(CYCLES * BLOCK):
        start = time.perf_counter()
        step(ids, with_ids)
        times.append(time.perf_counter() - start)
    with scope.call("Free") as call:
        service.free(call, ids, SESSION)
    return np.array(times) * 1e6


def phases(label: str, times: np.ndarray) -> None:
    phase = np.arange(times.size) % BLOCK  # a cycle starts right after the warm-up's fill: step 0 seals
    quiet = times[(phase != 0) & (phase != BLOCK - 1)]
    print(f"{label:38s} quiet p50 {np.median(quiet):7.1f}  fill {np.median(times[phase == BLOCK - 1]):7.1f}  "
          f"seal {np.median(times[phase == 0]):7.1f}  mean {times.mean():7.1f}")


def main() -> None:
    try:
        phases("core append (token ids)", timed(core_step, True, False))
        phases("record round (token ids)", timed(record_step, True, False))
        phases("record round (no token ids)", timed(record_step, False, False))
        times = timed(record_step, True, True)
        print(f"{'record round (token ids, staggered)':38s} p50 {np.median(times):7.1f}  p90 "
              f"{np.percentile(times, 90):7.1f}  p99 {np.percentile(times, 99):7.1f}  mean {times.mean():7.1f}")
    finally:
        views.release()
        service.guard.pool.close()


if __name__ == "__main__":
    main()
