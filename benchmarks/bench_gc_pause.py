"""The cyclic garbage collector's pauses in a serving server whose prefix cache is warm: the service layer in
process (the core, its prefix cache, the KV event log, a host tier with ``--host-tier``), 256 sequences at a time
registered with distinct prompts, decoded with token ids (a block sealed every 16th step of each row) and freed,
round after round, until ~131 k blocks are cached and then on while they are evicted and replaced.

Prints, per generation, the pauses the collector's callbacks saw (``gc.callbacks``: count, p50, p99, max) and the
objects a full collection walked (the tracked objects of generation 2 before it), then the step latencies (p50,
p99, max, steps over 5 ms, and the longest step a full collection ran in). Each configuration runs in a child
process of its own (a fresh heap); docs/results.md has the figures::

    git archive a1f5cb0 server common | tar -x -C /tmp/gcbefore     # the tree before the untracked records
    .venv/bin/python benchmarks/bench_gc_pause.py --no-policy --before /tmp/gcbefore

``--no-policy`` runs the current tree without ``gc_policy.apply`` (the collector as Python sets it up) beside it;
``--before DIR`` adds the tree in DIR (its ``server`` and ``common`` on PYTHONPATH, with the start-up freeze that
tree's server made: ``process.freeze_startup_heap``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections import Counter

import numpy as np

NUM_SEQS, PROMPT_LEN, STEPS_PER_ROUND = 256, 20, 500
PAUSE_LIMIT_S = 0.005


def child(num_blocks: int, rounds: int, policy: str, host_tier: bool) -> dict:
    from kvpool.v1 import kvpool_pb2 as pb
    from kvpool_server.config import ServerConfig
    from kvpool_server.grpc_api.methods import RPCS
    from kvpool_server.service.build import build_service
    from kvpool_server.service.scope import CallScope

    block_bytes = 16 * 2 * 4  # block_size 16, one layer, one head of one float32
    config = ServerConfig(backend="host", num_blocks=num_blocks, block_size=16, num_layers=1, num_kv_heads=1,
                          head_dim=1, dtype="float32", max_seq_len=8192, max_num_seqs=4096, max_batch=4096,
                          host_tier_bytes=num_blocks * block_bytes if host_tier else 0,
                          host_tier_writeback_blocks=0)
    service, admission = build_service(config)
    scope = CallScope(admission, None, None)

    def rpc(name: str, request: object) -> object:
        method = RPCS[name]
        with scope.call(name) as call:
            return method.encode(service, method.invoke(service, call, request))  # type: ignore[union-attr]

    if policy == "current":
        from kvpool_server import gc_policy

        gc_policy.apply()
    elif policy == "before":  # what that tree's server did after start-up
        from kvpool_server.process import freeze_startup_heap

        freeze_startup_heap()
    pauses: list[tuple[int, float, int]] = []  # (generation, seconds, objects in generation 2 before it)
    started = [0.0, 0]
    full = [0]  # full collections so far
    in_full: list[float] = []  # the steps a full collection ran in

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[1] = len(gc.get_objects(2)) if info["generation"] == 2 else 0
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0], started[1]))
            full[0] += info["generation"] == 2

    rng = np.random.default_rng(0)
    # The benchmark's own state holds nothing the collector walks (no list of lists of token ids), so that what
    # a full collection walks is the server's.
    steps = np.zeros(rounds * STEPS_PER_ROUND)
    done = 0
    gc.callbacks.append(on_gc)
    for _ in range(rounds):
        prompts = rng.integers(1, 2**31, size=(NUM_SEQS, PROMPT_LEN), dtype=np.uint32)
        ids = [rpc("RegisterSequence", pb.RegisterSequenceRequest(prompt_token_ids=p.tolist())).seq_id  # type: ignore[attr-defined]
               for p in prompts]
        rpc("AppendToken", pb.AppendTokenRequest(seq_ids=ids, num_tokens=[PROMPT_LEN] * NUM_SEQS,
                                                 token_ids=prompts.ravel().tolist()))
        tokens = rng.integers(1, 2**31, size=(STEPS_PER_ROUND, NUM_SEQS), dtype=np.uint32)
        requests = [pb.AppendTokenRequest(seq_ids=ids, token_ids=t.tolist()).SerializeToString() for t in tokens]
        for raw in requests:
            at, num_full = time.perf_counter(), full[0]
            rpc("AppendToken", pb.AppendTokenRequest.FromString(raw))
            steps[done] = time.perf_counter() - at
            if full[0] != num_full:
                in_full.append(steps[done])
            done += 1
        rpc("Free", pb.FreeRequest(seq_ids=ids))
    gc.callbacks.remove(on_gc)
    cache = service.guard.manager.allocator.cache
    kinds = Counter(type(o).__name__ for o in gc.get_objects(2)).most_common(4)
    service.guard.pool.close()
    return {"pauses": pauses, "steps": steps.tolist(), "in_full": in_full, "cached": cache.num_cached, "evicted": cache.num_evicted,
            "old": kinds, "tracked": len(gc.get_objects())}


def report(name: str, result: dict) -> None:
    print(f"{name}: {len(result['steps'])} steps, {result['cached']} blocks cached at the end, "
          f"{result['evicted']} evicted; {result['tracked']:,} objects tracked, generation 2's most: "
          + ", ".join(f"{n:,} {kind}" for kind, n in result["old"]))
    for generation in range(3):
        rows = [(s, n) for g, s, n in result["pauses"] if g == generation]
        if not rows:
            print(f"  gen {generation}: no collection")
            continue
        ms = np.array([s for s, _ in rows]) * 1e3
        walked = f", {max(n for _, n in rows):,} objects walked at most" if generation == 2 else ""
        print(f"  gen {generation}: {len(ms):5d} collections, pause p50 {np.percentile(ms, 50):7.3f} ms, "
              f"p99 {np.percentile(ms, 99):7.3f} ms, max {ms.max():7.3f} ms{walked}")
    us = np.array(result["steps"]) * 1e6
    print(f"  steps: p50 {np.percentile(us, 50):7.1f} us, p99 {np.percentile(us, 99):7.1f} us, "
          f"max {us.max() / 1e3:7.2f} ms, {int((us > PAUSE_LIMIT_S * 1e6).sum())} steps over "
          f"{PAUSE_LIMIT_S * 1e3:.0f} ms")
    if result["in_full"]:
        print(f"  steps a full collection ran in: {len(result['in_full'])}, the longest "
              f"{max(result['in_full']) * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-blocks", type=int, default=140_000, help="the pool's blocks (what is cached)")
    parser.add_argument("--rounds", type=int, default=40, help=f"rounds of {STEPS_PER_ROUND} steps")
    parser.add_argument("--host-tier", action="store_true", help="a host tier as large as the pool")
    parser.add_argument("--no-policy", action="store_true", help="also the current tree without gc_policy.apply")
    parser.add_argument("--before", metavar="DIR", help="also the tree in DIR (server/ and common/)")
    parser.add_argument("--child", choices=("current", "none", "before"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.num_blocks, args.rounds, args.child, args.host_tier)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [("before (" + args.before + ")", "before", args.before)] if args.before else []
    runs += [("no policy", "none", None)] if args.no_policy else []
    runs += [("gc_policy.apply", "current", None)]
    for name, policy, tree in runs:
        env = dict(os.environ)
        if tree:
            env["PYTHONPATH"] = os.pathsep.join([os.path.join(tree, "server"), os.path.join(tree, "common")])
        command = [sys.executable, os.path.join(here, "benchmarks", "bench_gc_pause.py"), "--child", policy,
                   "--num-blocks", str(args.num_blocks), "--rounds", str(args.rounds)]
        out = subprocess.run(command + (["--host-tier"] if args.host_tier else []), env=env, check=True,
                             capture_output=True, text=True).stdout
        report(name, json.loads(out.strip().splitlines()[-1]))


if __name__ == "__main__":
    main()
