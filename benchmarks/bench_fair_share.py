"""One frontend's heavy requests against the others (issue 30, item 16): two frontends step alone, then while a
third floods 32k-token registers back to back, in alternating phases of one run.

    frontends  one over the fast path, one over gRPC (fast_path=False): each its own process and session, stepping
               ``append(ids, 1)`` on ``--seqs`` sequences back to back for the whole run
    flooder    its own process and session: ``register_prompt`` of ``--prompt-tokens`` random tokens, then ``free``,
               back to back, during the flood phases only -- over the fast path (``flood-fast``) or gRPC
               (``flood-grpc``)
    Health     the parent checks the server's Health every 10 ms throughout

Phases: alone, flood-fast, alone, flood-grpc, ... (``--rounds`` of each, ``--phase-s`` seconds each; the first
0.3 s of a phase is not counted). Prints each frontend's steps/s, p50 and p99 per phase kind, Health's p50/p99,
the flooder's registers/s, and the ratio under each flood to alone.

    .venv/bin/python benchmarks/bench_fair_share.py --rounds 3 --phase-s 3 --pin 0
    (--pin SERVER_CPU: the server on that CPU, every client on the others; --before DIR: the server of an older
    tree unpacked in DIR -- ``git archive REV server common | tar -x -C DIR`` -- instead of this tree's)
(the fair share's own cost per fast-path record: bench_fair_cost.py)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import time
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench_service_servers import Server  # this directory

SKIP_S = 0.3  # the start of a phase, not counted (the flooder starting or stopping)
RESET_EVERY = 4000  # steps; below the server's --max-seq-len: free and register again (its time left out)


def phases_of(plan: Any, ready: Any) -> list[tuple[str, float, float]]:
    """Once this worker is set up: say so, and wait for the parent's phases (made once every worker is set up, so
    that a loaded machine's slow start-up never eats into the first phases)."""
    ready.put(os.getpid())
    while "phases" not in plan:
        time.sleep(0.01)
    return list(plan["phases"])


def frontend(args: tuple) -> tuple[np.ndarray, np.ndarray, bool]:
    """Steps from the first phase to the end of the last: (each step's end time, its latency, whether the fast
    path was used)."""
    address, num_seqs, fast, cpus, plan, ready = args
    if cpus:
        os.sched_setaffinity(0, cpus)
    from kvpool_client import KVPoolClient

    ends, latencies = [], []
    with KVPoolClient(address, fast_path=fast, lease_ttl_s=60.0) as client:
        ids = [client.register() for _ in range(num_seqs)]
        client.append(ids, 1)
        used_fast = client.fast_path_open
        phases = phases_of(plan, ready)
        start_at, end_at = phases[0][1], phases[-1][2]
        time.sleep(max(0.0, start_at - time.time()))
        while (now := time.time()) < end_at:
            t0 = time.perf_counter()
            client.append(ids, 1)
            latencies.append(time.perf_counter() - t0)
            ends.append(now)
            if len(latencies) % RESET_EVERY == 0:
                client.free(ids)
                ids = [client.register() for _ in range(num_seqs)]
    return np.array(ends), np.array(latencies), used_fast


def flooder(args: tuple) -> list[tuple[float, float, int]]:
    """During each (start, end) window: registers of ``prompt_tokens`` tokens and frees, back to back, over
    the fast path or gRPC; (start, end, registers) a window."""
    address, fast, prompt_tokens, cpus, plan, ready = args
    if cpus:
        os.sched_setaffinity(0, cpus)
    from kvpool_client import KVPoolClient

    rng = np.random.default_rng(0)
    done = []
    with KVPoolClient(address, fast_path=fast, lease_ttl_s=60.0) as client:
        kind = "flood-fast" if fast else "flood-grpc"
        for start, end in [(s, e) for name, s, e in phases_of(plan, ready) if name == kind]:
            time.sleep(max(0.0, start - time.time()))
            count = 0
            while time.time() < end:
                seq_id, _ = client.register_prompt(rng.integers(0, 50_000, prompt_tokens, dtype=np.uint32))
                client.free([seq_id])
                count += 1
            done.append((start, end, count))
            assert not fast or client.fast_path_open, "the flooder's fast path closed"
    return done


def health_probe(address: str, end_at: float) -> tuple[np.ndarray, np.ndarray]:
    ends, latencies = [], []
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (now := time.time()) < end_at:
            t0 = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            latencies.append(time.perf_counter() - t0)
            ends.append(now)
            time.sleep(0.01)
    return np.array(ends), np.array(latencies)


def in_phases(ends: np.ndarray, values: np.ndarray, phases: list[tuple[str, float, float]], kind: str) -> np.ndarray:
    mask = np.zeros(ends.size, dtype=bool)
    for name, start, end in phases:
        if name == kind:
            mask |= (ends >= start + SKIP_S) & (ends < end)
    return values[mask]


def counted_s(phases: list[tuple[str, float, float]], kind: str) -> float:
    return sum(end - start - SKIP_S for name, start, end in phases if name == kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (alone, flood-fast, alone, flood-grpc)")
    parser.add_argument("--phase-s", type=float, default=3.0)
    parser.add_argument("--seqs", type=int, default=8, help="sequences per frontend (one append of all a step)")
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--floods", default="fast,grpc", help="the flooder's transports, one phase kind each")
    parser.add_argument("--pin", type=int, default=None, metavar="SERVER_CPU")
    parser.add_argument("--flooder-cpu", type=int, default=None, help="the flooder on this CPU (default: with the "
                        "other clients); to tell its client's work from the server's")
    parser.add_argument("--before", metavar="DIR", help="the server of an older tree unpacked in DIR")
    parser.add_argument("server_args", nargs="*", help="after --: extra kvpool-server flags")
    args = parser.parse_args()
    cpus = None
    if args.pin is not None:
        os.environ["KVPOOL_BENCH_SERVER_CPUS"] = str(args.pin)
        cpus = os.sched_getaffinity(0) - {args.pin} or None
        os.sched_setaffinity(0, cpus or os.sched_getaffinity(0))
    kind = "kvpool"
    if args.before:
        os.environ["KVPOOL_BENCH_BEFORE"] = os.path.abspath(args.before)
        kind = "kvpool-before"
    floods = [f.strip() for f in args.floods.split(",") if f.strip()]
    server = Server(kind, ["--max-seq-len", str(2 * args.prompt_tokens), "--max-sessions", "64",
                           *args.server_args], "unix")
    ctx = mp.get_context("spawn")
    print(f"{os.cpu_count()} CPUs; server pinned to {args.pin}; {kind}; frontends of {args.seqs} sequences; "
          f"flooder: {args.prompt_tokens}-token registers; {args.rounds} rounds of {args.phase_s:g} s phases")
    try:
        with ctx.Manager() as manager, ctx.Pool(2 + len(floods)) as pool:
            plan, ready = manager.dict(), manager.Queue()
            fronts = [pool.apply_async(frontend, ((server.address, args.seqs, fast, cpus, plan, ready),))
                      for fast in (True, False)]
            flooders = {flood: pool.apply_async(flooder, ((
                server.address, flood == "fast", args.prompt_tokens,
                cpus if args.flooder_cpu is None else {args.flooder_cpu}, plan, ready),)) for flood in floods}
            workers, set_up = [*fronts, *flooders.values()], 0
            while set_up < len(workers):  # every worker set up; one that failed meanwhile raises here
                try:
                    ready.get(timeout=1)
                    set_up += 1
                except queue.Empty:
                    for worker in workers:
                        if worker.ready():
                            worker.get()
            phases, at = [], time.time() + 1.5
            for _ in range(args.rounds):
                for flood in floods:
                    phases += [("alone", at, at + args.phase_s),
                               (f"flood-{flood}", at + args.phase_s, at + 2 * args.phase_s)]
                    at += 2 * args.phase_s
            end_at = at
            plan["phases"] = phases
            health = health_probe(server.address, end_at)
            results = [f.get(timeout=end_at - time.time() + 120) for f in fronts]
            floods_done = {flood: f.get(timeout=120) for flood, f in flooders.items()}
    finally:
        server.stop()
    kinds = ["alone", *[f"flood-{f}" for f in floods]]
    print(f"{'phase':<12} {'frontend':<9} {'steps/s':>8} {'p50 ms':>7} {'p99 ms':>7}   {'ratio':>5}")
    alone_rate = {}
    for phase in kinds:
        for (ends, lat, used_fast), name in zip(results, ("fast-path", "gRPC")):
            steps = in_phases(ends, lat, phases, phase)
            rate = steps.size / counted_s(phases, phase)
            alone_rate.setdefault(name, rate)
            print(f"{phase:<12} {name:<9} {rate:8.0f} {np.percentile(steps, 50) * 1e3:7.2f} "
                  f"{np.percentile(steps, 99) * 1e3:7.2f}   {rate / alone_rate[name]:5.2f}"
                  + ("" if used_fast or name == "gRPC" else "  (fast path NOT used)"))
        h = in_phases(*health, phases, phase)
        line = f"{phase:<12} {'Health':<9} {'':>8} {np.percentile(h, 50) * 1e3:7.2f} {np.percentile(h, 99) * 1e3:7.2f}"
        if phase != "alone":
            flood = phase.removeprefix("flood-")
            registers = sum(c for _, _, c in floods_done[flood])
            line += f"   flooder: {registers / (args.rounds * args.phase_s):.0f} registers/s"
        print(line)
    print("per round (each flood phase against the alone phase just before it):")
    for (ends, _, _), name in zip(results, ("fast-path", "gRPC")):
        for flood in floods:
            ratios = [np.sum((ends >= fs + SKIP_S) & (ends < fe)) / max(1, np.sum((ends >= a + SKIP_S) & (ends < ae)))
                      for (_, a, ae), (kind, fs, fe) in zip(phases[::2], phases[1::2]) if kind == f"flood-{flood}"]
            print(f"  {name:<9} flood-{flood:<5} ratios {' '.join(f'{r:.2f}' for r in ratios)}  "
                  f"median {np.median(ratios):.2f}")


if __name__ == "__main__":
    main()
