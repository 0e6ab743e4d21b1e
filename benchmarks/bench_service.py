"""kvpool service benchmark: one decode step of 256 sequences as a single AppendToken call, over gRPC.

Every server is a separate process started by this script, one at a time:

  echo             a bare sync gRPC server whose one method returns the 256 request ids as 256 int64s
                   (AppendTokenRequest in, AppendTokenResponse out: the same message shapes as a decode step)
  echo-aio         the same echo on grpc.aio: the baseline of kvpool, which is a grpc.aio server
  kvpool           the real ``kvpool-server`` console script (grpc.aio, host backend)
  echo-stream      the sync echo's bidi EchoStream: one stream, one echo message per step (same message shapes)
  echo-aio-stream  the same on the grpc.aio echo: the baseline of kvpool-stream
  kvpool-stream    the real ``kvpool-server``, AppendTokenStream: one stream, one message per step
  kvpool-fast      the real ``kvpool-server``, the decode step over the session's shared-memory fast path
                   (``KVPoolClient.append``: docs/fast-path.md); ``kvpool-fast-tokens``: with the 256 token ids
  kvpool-before    with ``--before DIR``: the real server of an older tree (``git archive REV server common | tar -x
                   -C DIR``), and ``kvpool-before-stream``; run in the same rounds, so ``kvpool / kvpool-before`` is
                   a change's cost measured in one run
  kvpool-inproc    kvpool_server.grpc_server.build_server's server started by bench_service_servers.py, without
                   main.serve() around it (no signal loop, no GC freeze): a diagnostic for the process around it

For each: one client doing back-to-back steps (steps/s, p50, p99 latency), then ``--clients`` client processes at
once (aggregate steps/s; not for the -stream kinds, whose figure is one client holding one stream). For kvpool also
the naive way: one unary AppendToken per sequence per step.
Run: ``.venv/bin/python benchmarks/bench_service.py`` (``make bench-service``); ``--quick`` for a short run.
``--transport unix``: every server listens on a unix domain socket (in a fresh temp dir) instead of 127.0.0.1.
The servers are in bench_service_servers.py.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import time

import grpc
import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

from bench_service_servers import ECHO_METHOD, ECHO_STREAM_METHOD, Server  # this directory

NUM_SEQS = 256
# A decode step's cost does not depend on the KV size, so the pool has tiny tokens (head_dim 1: 8 bytes) and room
# for 8192 steps of 1024 sequences: no client has to free and re-register (256 extra calls) during a measurement.
RESET_EVERY = 8000  # steps; then every sequence is freed and re-registered (untimed)
# The echo carries the ids a fresh kvpool-server gives its first 256 sequences (serial << 12 | row, the default
# max_num_seqs of 4096 giving 12 row bits): the same varint widths as kvpool's own requests, so that both servers
# move the same bytes. (Ids 1..256 would be 1-2-byte varints, lighter than any real decode step.)
ECHO_IDS = [(serial << 12) | row for row, serial in zip(range(NUM_SEQS), range(1, NUM_SEQS + 1))]


# ------------------------------------------------------------------------------------------------ clients
def open_stream(call: grpc.StreamStreamMultiCallable) -> tuple:
    """One bidi stream: (exchange(request) -> its response, close()). The same driver for echo and kvpool."""
    requests: queue.SimpleQueue = queue.SimpleQueue()
    responses = call(iter(requests.get, None))

    def exchange(request):  # type: ignore[no-untyped-def]
        requests.put(request)
        return next(responses)

    def close() -> None:
        requests.put(None)
        for _ in responses:
            pass

    return exchange, close


def server_kind(kind: str) -> str:
    """The server a kind measures (the -stream and -fast kinds use the same servers)."""
    return kind.removesuffix("-stream").removesuffix("-tokens").removesuffix("-fast")


def run_client(kind: str, address: str, mode: str, duration_s: float, start_at: float | None = None) -> list[float]:
    """Back-to-back steps for ``duration_s``; returns each step's latency in seconds."""
    channel = grpc.insecure_channel(address)
    streaming = kind.endswith("-stream")
    close = None
    if "-fast" in kind:
        step, reset, close = fast_client(kind, address)
    elif kind.startswith("echo"):
        if streaming:
            exchange, close = open_stream(channel.stream_stream(
                ECHO_STREAM_METHOD,
                request_serializer=pb.AppendTokenStreamRequest.SerializeToString,
                response_deserializer=pb.AppendTokenStreamResponse.FromString,
            ))
            request = pb.AppendTokenStreamRequest(seq_ids=ECHO_IDS)
        else:
            exchange = channel.unary_unary(
                ECHO_METHOD,
                request_serializer=pb.AppendTokenRequest.SerializeToString,
                response_deserializer=pb.AppendTokenResponse.FromString,
            )
            request = pb.AppendTokenRequest(seq_ids=ECHO_IDS)

        def step() -> None:
            assert len(exchange(request).slot_mapping) == NUM_SEQS

        reset = None
    else:
        stub = pb_grpc.KVPoolServiceStub(channel)
        state: dict = {}
        request_cls = pb.AppendTokenStreamRequest if streaming else pb.AppendTokenRequest

        def reset() -> None:
            if "ids" in state:
                stub.Free(pb.FreeRequest(seq_ids=state["ids"]))
            state["ids"] = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(NUM_SEQS)]
            state["batch"] = request_cls(seq_ids=state["ids"])
            state["singles"] = [pb.AppendTokenRequest(seq_ids=[s]) for s in state["ids"]]

        reset()
        if streaming:
            exchange, close = open_stream(stub.AppendTokenStream)

            def step() -> None:
                assert len(exchange(state["batch"]).slot_mapping) == NUM_SEQS

        elif mode == "batched":

            def step() -> None:
                assert len(stub.AppendToken(state["batch"]).slot_mapping) == NUM_SEQS

        else:

            def step() -> None:
                for single in state["singles"]:
                    stub.AppendToken(single)

    for i in range(50):  # warm up
        step()
        if reset is not None and i == 49:
            reset()
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    latencies: list[float] = []
    steps_since_reset = 0
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        step()
        latencies.append(time.perf_counter() - t0)
        steps_since_reset += 1
        if reset is not None and steps_since_reset == RESET_EVERY:
            reset()
            steps_since_reset = 0
    if close is not None:
        close()
    channel.close()
    return latencies


def fast_client(kind: str, address: str) -> tuple:
    """(step, reset, close) of a KVPoolClient whose appends go over its fast-path channel."""
    from kvpool_client import KVPoolClient

    client = KVPoolClient(address, fast_path=True)
    state: dict = {}
    token_ids = np.arange(NUM_SEQS, dtype=np.uint32) if kind.endswith("-tokens") else None

    def reset() -> None:
        if "ids" in state:
            client.free(state["ids"])
        state["ids"] = [client.register() for _ in range(NUM_SEQS)]

    def step() -> None:
        assert client.append(state["ids"], 1, token_ids=token_ids).slot_mapping.size == NUM_SEQS

    reset()
    assert client.fast_path_open, "the fast path did not open (is the server local?)"
    return step, reset, client.close


def _client_proc(args: tuple) -> tuple[int, float]:
    latencies = run_client(*args)
    return len(latencies), sum(latencies)


def summarize(latencies: list[float]) -> dict[str, float]:
    lat = np.array(latencies)
    return {
        "steps_per_s": len(lat) / lat.sum(),
        "p50_us": float(np.percentile(lat, 50) * 1e6),
        "p99_us": float(np.percentile(lat, 99) * 1e6),
    }


def measure(
    kind: str, duration_s: float, clients: int, naive: bool, extra_args: list[str], transport: str = "tcp"
) -> dict[str, dict[str, float]]:
    server = Server(server_kind(kind), extra_args, transport)
    try:
        results = {"1 client": summarize(run_client(kind, server.address, "batched", duration_s))}
        if clients > 1 and not kind.endswith("-stream"):
            ctx = mp.get_context("spawn")
            start_at = time.time() + 3.0  # after every client process has imported and warmed up
            with ctx.Pool(clients) as workers:
                per_client = workers.map(
                    _client_proc, [(kind, server.address, "batched", duration_s, start_at)] * clients
                )
            results[f"{clients} clients"] = {"steps_per_s": sum(n / t for n, t in per_client)}
        if naive:
            results["naive 1 client"] = summarize(run_client(kind, server.address, "naive", duration_s))
    finally:
        server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("tcp", "unix"), default="tcp",
                        help="tcp: servers on 127.0.0.1 (default); unix: on a unix domain socket each")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per measurement")
    parser.add_argument("--clients", type=int, default=2, help="client processes for the concurrent figure")
    parser.add_argument("--rounds", type=int, default=2, help="alternate echo/kvpool this many times")
    parser.add_argument("--no-aio", action="store_true", help="skip the asyncio variants")
    parser.add_argument("--no-naive", action="store_true", help="skip the one-call-per-sequence figure")
    parser.add_argument("--quick", action="store_true", help="1 s per measurement, 1 round")
    parser.add_argument("--kinds", default="echo,echo-aio,kvpool,echo-stream,echo-aio-stream,kvpool-stream,"
                        "kvpool-fast,kvpool-fast-tokens",
                        help="servers to measure")
    parser.add_argument("--before", metavar="DIR", help="also measure the server of an older tree unpacked in DIR "
                        "(kinds kvpool-before, kvpool-before-stream), alternating with this tree's")
    parser.add_argument("server_args", nargs="*", help="after --: extra kvpool-server flags for every server")
    parser.add_argument("--pin", nargs="?", const="0,1", default=None, metavar="SERVER_CPU,CLIENT_CPU",
                        help="pin every server to one CPU and the clients to another (default 0,1): steadier "
                        "figures, and how a latency-sensitive server is deployed (kvpool-server --cpu-affinity)")
    args = parser.parse_args()
    if args.pin:
        server_cpu, client_cpu = (int(c) for c in args.pin.split(","))
        if not {server_cpu, client_cpu} <= os.sched_getaffinity(0):
            parser.error(f"--pin={args.pin}: this process may only use CPUs {sorted(os.sched_getaffinity(0))}")
        os.environ["KVPOOL_BENCH_SERVER_CPUS"] = str(server_cpu)
        os.sched_setaffinity(0, {client_cpu})
    if args.quick:
        args.duration, args.rounds = 1.0, 1
    kinds = [k for k in args.kinds.split(",") if not (args.no_aio and "-aio" in k)]
    if args.before:
        os.environ["KVPOOL_BENCH_BEFORE"] = os.path.abspath(args.before)
        kinds += [f"{k.replace('kvpool', 'kvpool-before')}" for k in kinds if k in ("kvpool", "kvpool-stream")]
    print(f"decode step = AppendToken (-stream: one AppendTokenStream message) of {NUM_SEQS} sequences x 1 token; "
          f"{os.cpu_count()} CPUs; {args.duration:.0f} s per figure; {args.rounds} rounds (best and median); "
          f"transport {args.transport}; server flags {args.server_args}")
    rounds: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for kind in kinds:
            results = measure(kind, args.duration, args.clients, kind == "kvpool" and not args.no_naive,
                              args.server_args, args.transport)
            for label, figures in results.items():
                rounds.setdefault((kind, label), []).append(figures)
    best = {key: max(runs, key=lambda f: f["steps_per_s"]) for key, runs in rounds.items()}
    median = {key: statistics.median(f["steps_per_s"] for f in runs) for key, runs in rounds.items()}
    # p50 and p99 of the best round, and the worst p99 of any round (the figure a latency goal must meet).
    print(f"{'server':<20} {'clients':<16} {'steps/s':>9} {'median':>9} {'entries/s':>11} {'p50 us':>8} {'p99 us':>8} "
          f"{'worst p99':>10}")
    for (kind, label), f in best.items():
        p50 = f"{f['p50_us']:8.0f}" if "p50_us" in f else f"{'':8}"
        p99 = f"{f['p99_us']:8.0f}" if "p99_us" in f else f"{'':8}"
        worst = max((r["p99_us"] for r in rounds[(kind, label)] if "p99_us" in r), default=None)
        worst_p99 = f"{worst:10.0f}" if worst is not None else f"{'':10}"
        print(f"{kind:<20} {label:<16} {f['steps_per_s']:9.0f} {median[(kind, label)]:9.0f} "
              f"{f['steps_per_s'] * NUM_SEQS:11.0f} {p50} {p99} {worst_p99}")
    print("ratios of best (median) steps/s:")
    for pair in (("kvpool", "echo-aio"), ("kvpool-stream", "echo-aio-stream"), ("kvpool", "echo"),
                 ("kvpool-stream", "echo-stream"), ("kvpool-stream", "kvpool"), ("echo-aio", "echo"),
                 ("echo-aio-stream", "echo-stream"), ("kvpool-inproc", "echo-aio"), ("kvpool", "kvpool-inproc"),
                 ("kvpool", "kvpool-before"), ("kvpool-stream", "kvpool-before-stream"),
                 ("kvpool-fast", "kvpool"), ("kvpool-fast", "kvpool-stream")):
        for label in ("1 client", f"{args.clients} clients"):
            a, b = (pair[0], label), (pair[1], label)
            if a in best and b in best:
                print(f"  {pair[0]} / {pair[1]} ({label}): {best[a]['steps_per_s'] / best[b]['steps_per_s']:.2f} "
                      f"({median[a] / median[b]:.2f})")
    naive, batched = ("kvpool", "naive 1 client"), ("kvpool", "1 client")
    if naive in best and batched in best:
        print(f"  batched / naive (kvpool, 1 client): {best[batched]['steps_per_s'] / best[naive]['steps_per_s']:.0f}x")


if __name__ == "__main__":
    main()
