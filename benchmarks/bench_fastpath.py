"""The fast path at scale (issue 21's targets): P frontend processes x S sequences, each a KVPoolClient stepping
``append(ids, 1)`` back to back over its session's shared-memory channel (or over gRPC, ``--grpc``), one
kvpool-server; the parent checks the server's Health every 10 ms meanwhile. Then N idle channels and the server's
CPU over ``--idle-s`` seconds.

Prints, for each P: aggregate steps/s and token-appends/s, the step's p50/p99 (all processes' steps), Health's
p50/p99; and the idle figure.

    .venv/bin/python benchmarks/bench_fastpath.py --procs 1,4,16 --seqs 64 --duration 3 --idle 64 --idle-s 10
    (--pin SERVER_CPU: the server on that CPU, the frontends on the others)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench_service_servers import Server  # this directory

RESET_EVERY = 4000  # steps; the server's --max-seq-len is 8192 (bench_service_servers.SERVER_ARGS)


def frontend(args: tuple) -> tuple[int, float, list[float], bool]:
    """One frontend process: S sequences, steps until ``end_at``; (steps, seconds, latencies, fast path used)."""
    address, num_seqs, fast, start_at, end_at, cpus = args
    if cpus:
        os.sched_setaffinity(0, cpus)
    from kvpool_client import KVPoolClient

    with KVPoolClient(address, fast_path=fast, lease_ttl_s=60.0) as client:
        ids = [client.register() for _ in range(num_seqs)]
        for _ in range(20):
            client.append(ids, 1)
        used_fast = client.fast_path_open
        time.sleep(max(0.0, start_at - time.time()))
        latencies = []
        began = time.perf_counter()
        untimed = 0.0
        while time.time() < end_at:
            t0 = time.perf_counter()
            client.append(ids, 1)
            latencies.append(time.perf_counter() - t0)
            if len(latencies) % RESET_EVERY == 0:  # below --max-seq-len: free and register again, untimed
                t1 = time.perf_counter()
                client.free(ids)
                ids = [client.register() for _ in range(num_seqs)]
                untimed += time.perf_counter() - t1
        return len(latencies), time.perf_counter() - began - untimed, latencies, used_fast


def health_probe(address: str, end_at: float) -> list[float]:
    latencies = []
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.time() < end_at:
            t0 = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
    return latencies


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_clients(args: tuple) -> None:
    address, count, ready, done = args
    from kvpool_client import KVPoolClient

    clients = [KVPoolClient(address, lease_ttl_s=30.0) for _ in range(count)]
    for client in clients:
        client.append(client.register(), 1)
    ready.put(sum(c.fast_path_open for c in clients))
    done.get()
    for client in clients:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", default="1,4,16", help="frontend process counts, one run each")
    parser.add_argument("--seqs", type=int, default=64, help="sequences per frontend (one append of all a step)")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--grpc", action="store_true", help="the frontends use gRPC (fast_path=False)")
    parser.add_argument("--idle", type=int, default=64, help="idle fast-path channels for the CPU figure (0: skip)")
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--pin", type=int, default=None, metavar="SERVER_CPU")
    parser.add_argument("--transport", choices=("tcp", "unix"), default="unix")
    parser.add_argument("server_args", nargs="*", help="after --: extra kvpool-server flags")
    args = parser.parse_args()
    cpus = None
    if args.pin is not None:
        os.environ["KVPOOL_BENCH_SERVER_CPUS"] = str(args.pin)
        cpus = os.sched_getaffinity(0) - {args.pin} or None
    server = Server("kvpool", ["--max-sessions", "4096", *args.server_args], args.transport)
    ctx = mp.get_context("spawn")
    print(f"{os.cpu_count()} CPUs; {'gRPC' if args.grpc else 'fast path'}; {args.seqs} sequences a frontend; "
          f"{args.duration:g} s a run; server pinned to {args.pin}")
    print(f"{'procs':>5} {'steps/s':>9} {'appends/s':>11} {'p50 us':>8} {'p99 us':>8} {'health p50':>11} "
          f"{'health p99':>11} {'fast':>5}")
    try:
        for procs in [int(p) for p in args.procs.split(",")]:
            start_at = time.time() + 2.0 + 0.2 * procs
            end_at = start_at + args.duration
            with ctx.Pool(procs) as pool:
                pending = pool.map_async(frontend, [(server.address, args.seqs, not args.grpc, start_at, end_at,
                                                     cpus)] * procs)
                time.sleep(max(0.0, start_at - time.time()))
                health = np.array(health_probe(server.address, end_at)) * 1e6
                results = pending.get()
            steps = sum(r[0] for r in results)
            rate = sum(r[0] / r[1] for r in results)
            lat = np.concatenate([r[2] for r in results]) * 1e6
            print(f"{procs:5d} {rate:9.0f} {rate * args.seqs:11.0f} {np.percentile(lat, 50):8.0f} "
                  f"{np.percentile(lat, 99):8.0f} {np.percentile(health, 50):11.0f} {np.percentile(health, 99):11.0f} "
                  f"{all(r[3] for r in results)!s:>5}  ({steps} steps)")
        if args.idle:
            ready, done = ctx.Queue(), ctx.Queue()
            per_proc = 16
            workers = [ctx.Process(target=idle_clients, args=((server.address, min(per_proc, args.idle - i), ready,
                                                                 done),))
                       for i in range(0, args.idle, per_proc)]
            for w in workers:
                w.start()
            opened = sum(ready.get(timeout=120) for _ in workers)
            time.sleep(1.0)
            before = cpu_seconds(server.proc.pid)
            time.sleep(args.idle_s)
            used = cpu_seconds(server.proc.pid) - before
            for _ in workers:
                done.put(None)
            for w in workers:
                w.join(60)
            print(f"idle: {opened} fast-path channels open, server CPU {used / args.idle_s:.2%} of a core over "
                  f"{args.idle_s:g} s")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
