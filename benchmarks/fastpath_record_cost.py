"""What one fast-path record costs in Python, in one process and without the wake: the client's write of the
256-sequence append record (``KVPoolClient.append``'s plan: ``fast_args`` and ``append_writer``), the server's
``serve_record`` (scope, admission, the service, the guard, the core, the reply), the client's read of the reply
into its ``AppendResult``, and the core's ``manager.append`` alone beside it -- each the median of its own timings
(microseconds), best of ``--rounds``. ``--metrics``: the server's metrics on (the RPC histogram, the append
counter); ``--auth``: a tokens file (every record authenticated); ``--tokens``: the step carries 256 token ids.
Run it on two trees to compare them (the after tree's script on both)::

    git archive OLD server client common | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/server:/tmp/old/client:/tmp/old/common taskset -c 1 .venv/bin/python benchmarks/fastpath_record_cost.py
    taskset -c 1 .venv/bin/python benchmarks/fastpath_record_cost.py
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import tempfile
import time

import numpy as np

from kvpool import fastpath as fp
from kvpool_client import fastpath_records as ops
from kvpool_client.fast_args import append_args, uint32_tokens
from kvpool_server.config import ServerConfig
from kvpool_server.fastpath.records import ChannelHeaders, serve_record
from kvpool_server.service.build import build_service
from kvpool_server.service.metrics import KVPoolMetrics
from kvpool_server.service.scope import CallScope

NUM_SEQS, GENERATION, AREA, TOKEN = 256, 7, 1 << 20, "bench-token"
RESET_EVERY = 4000  # steps: below --max-seq-len 8192, then the sequences are freed and registered again


def tokens_file() -> str:
    fd, path = tempfile.mkstemp(suffix=".toml")
    with os.fdopen(fd, "w") as f:
        digest = hashlib.sha256(TOKEN.encode()).hexdigest()
        f.write(f'[tenants.bench]\n[[tokens]]\nsha256 = "{digest}"\ntenant = "bench"\nrole = "frontend"\n')
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--metrics", action="store_true")
    parser.add_argument("--auth", action="store_true")
    parser.add_argument("--tokens", action="store_true")
    args = parser.parse_args()
    config = ServerConfig(backend="host", head_dim=1, num_blocks=1 << 19, max_seq_len=8192,
                          auth_tokens=tokens_file() if args.auth else None)
    metrics = KVPoolMetrics() if args.metrics else None
    service, admission = build_service(config, metrics=metrics)
    scope = CallScope(admission, service.auth, metrics)
    authorization = f"Bearer {TOKEN}" if args.auth else None
    headers = ChannelHeaders(authorization)

    class Meta:
        def get(self, key: str) -> str | None:
            return authorization if key == "authorization" else None

    with scope.call("OpenSession", Meta()) as opening:
        session = service.sessions.open(opening).session_id
        tenant = opening.caller.tenant_id
    views = fp.Views(mmap.mmap(-1, fp.segment_bytes(AREA)), AREA)
    rng = np.random.default_rng(0)
    step_tokens = rng.integers(0, 2**31, size=(64, NUM_SEQS), dtype=np.uint32)
    seq = 0

    def register() -> list[int]:
        with scope.call("RegisterSequence", Meta()) as call:
            return [service.register(call, None, session).seq_id for _ in range(NUM_SEQS)]

    def free(ids: list[int]) -> None:
        with scope.call("Free", Meta()) as call:
            service.free(call, ids, session)

    ids = register()
    best: dict[str, float] = {}
    done = 0
    perf = time.perf_counter
    for _ in range(args.rounds):
        times: dict[str, list[float]] = {"client write": [], "serve_record": [], "client read": [], "core": []}
        for step in range(args.steps):
            if done and done % RESET_EVERY == 0:
                free(ids)
                ids = register()
            done += 1
            t0 = perf()
            fast = append_args(ids, 1)
            assert fast is not None
            toks = uint32_tokens(step_tokens[step % 64]) if args.tokens else None
            ops.append_writer(GENERATION, fast[1], fast[3], toks, 0)(views)
            seq += 1
            views.req[fp.REQ_SEQ] = seq
            t1 = perf()
            serve_record(service, scope, views, headers, session, GENERATION, seq)
            t2 = perf()
            assert views.rep[fp.REP_CODE] == 0, "the step failed"
            ops.append_reader(fast[0], fast[2])(views)
            t3 = perf()
            times["client write"].append(t1 - t0)
            times["serve_record"].append(t2 - t1)
            times["client read"].append(t3 - t2)
        with service.guard.lock:  # the core alone, on the same sequences
            id_array = np.array(ids, dtype=np.uint64)
            for step in range(args.steps // 4):
                toks = step_tokens[step % 64] if args.tokens else None
                t0 = perf()
                service.guard.manager.append(id_array, 1, tenant, toks)
                times["core"].append(perf() - t0)
                done += 1
                if done % RESET_EVERY == 0:
                    break
        for name, values in times.items():
            if values:
                best[name] = min(best.get(name, float("inf")), float(np.median(values)) * 1e6)
    flags = " ".join(f for f, on in (("--metrics", args.metrics), ("--auth", args.auth), ("--tokens", args.tokens))
                     if on) or "(metrics off, no auth, no token ids)"
    print(f"one 256-sequence append record, {flags}: median us, best of {args.rounds} x {args.steps} steps")
    for name in ("client write", "serve_record", "client read", "core"):
        print(f"  {name:14s} {best[name]:7.1f}")
    print(f"  {'service layer':14s} {best['serve_record'] - best['core']:7.1f}  (serve_record - core)")
    views.release()
    service.guard.pool.close()


if __name__ == "__main__":
    main()
