"""KV events on vLLM's ZMQ wire (--kv-events-publish): block events/s reaching a ZMQ subscriber process, whether any
were lost, and what the publisher costs AppendToken (docs/scale-out.md).

A real ``kvpool-server`` process (host pool, unix socket, 16-token blocks, ``--kv-events-publish ipc://...``) and:

  driver      this process, as benchmarks/bench_events.py drives it: ``--seqs`` sequences, each AppendToken adds
              ``--tokens-per-call`` tokens to every one with their ids (each call seals the blocks the previous
              call filled); full sequences are freed and the pool, once full of cached blocks, evicts.
  subscriber  a separate process with a ZMQ SUB socket that decodes every message as llm-d does (msgpack, the
              array layout, tags first: tests/zmq_events/zmq_consumer.py), counts block events (each hash of a
              BlockStored or BlockRemoved), checks that sequence numbers have no gap (none lost), and builds the
              router's index; at the end it compares that index with the server's cache (a gRPC snapshot).

Then the latency part: the same server started twice, without and with the publisher, and a decode-like loop
(``--latency-seqs`` sequences, one token each with its id per AppendToken) timed call by call: p50 and p99 for
each, and their ratio (issue 25's target: p99 with the publisher <= 1.1x without).
Run: ``.venv/bin/python benchmarks/bench_zmq_events.py`` (``--seconds 2`` for a short run). Needs pyzmq and msgpack.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

import grpc
import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

from bench_events import OPTIONS, drive, driver_arguments  # this directory
from bench_service_servers import Server

MODEL = "bench-model"


def subscriber(endpoint: str, replay: str, address: str, ready, done, results) -> None:  # type: ignore[no-untyped-def]
    """Receive until ``done`` is set and no message came for 2 s; put the figures in ``results``."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from kvpool_client import KVPoolClient, fetch_snapshot
    from kvpool_server.zmq_events.wire import engine_hash, model_mask
    from tests.zmq_events.zmq_consumer import Index, Subscriber, decode_like_llmd

    sub = Subscriber(endpoint, replay)
    index = Index()
    opening = sub.replay(0)
    for _, payload in opening:
        index.apply(decode_like_llmd(payload))
    last_seq = opening[-1][0] if opening else None
    gaps = events = messages = 0
    first = last = 0.0
    ready.set()
    while True:
        message = sub.recv(2.0)
        if message is None:
            if done.is_set():
                break
            continue
        now = time.perf_counter()
        first = first or now
        last = now
        messages += 1
        if last_seq is not None and message.seq != last_seq + 1:
            gaps += 1
        last_seq = message.seq
        decoded = decode_like_llmd(message.payload)
        events += sum(len(e[1]) for e in decoded if e[0] in ("BlockStored", "BlockRemoved"))
        index.apply(decoded)
    mask = model_mask(MODEL)
    with KVPoolClient(address, session=False, timeout=60) as client:
        server = fetch_snapshot(client, timeout=60).blocks
    expected = {engine_hash(h, mask): (engine_hash(b.parent_hash, mask) if b.parent_hash else 0,
                                       tuple(int(t) for t in b.token_ids)) for h, b in server.items()}
    sub.close()
    elapsed = max(last - first, 1e-9)
    results.put({"events_per_s": events / elapsed, "events": events, "messages": messages, "elapsed_s": elapsed,
                 "gaps": gaps, "equal": index.blocks == expected, "num_blocks": len(index.blocks)})


def throughput(args: argparse.Namespace) -> None:
    ipc = tempfile.mkdtemp(prefix="kvz-", dir="/tmp")
    endpoint, replay = f"ipc://{ipc}/pub", f"ipc://{ipc}/replay"
    server = Server("kvpool", ["--num-blocks", str(args.num_blocks), "--max-seq-len", str(args.max_seq_len),
                               "--block-size", str(args.block_size), "--kv-events-publish", endpoint,
                               "--kv-events-replay", replay, "--kv-events-model", MODEL], transport="unix")
    ctx = mp.get_context("spawn")
    ready, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
    sub = ctx.Process(target=subscriber, args=(endpoint, replay, server.address, ready, done, results), daemon=True)
    try:
        sub.start()
        if not ready.wait(60):
            raise RuntimeError("the subscriber did not start")
        with grpc.insecure_channel(server.address, options=OPTIONS) as channel:
            driven = drive(pb_grpc.KVPoolServiceStub(channel), args.seconds, args.seqs, args.tokens_per_call,
                           args.max_seq_len)
        done.set()
        got = results.get(timeout=600)
        sub.join(30)
    finally:
        server.stop()
    blocks_per_call = args.seqs * args.tokens_per_call // args.block_size
    print(f"kvpool KV events on ZMQ: {args.seqs} sequences x {args.tokens_per_call} tokens a call ({blocks_per_call} "
          f"blocks sealed a call), block size {args.block_size}, pool {args.num_blocks} blocks, {args.seconds:g} s")
    print(f"  driver      {driven['calls_per_s']:8.1f} AppendToken calls/s, "
          f"{driven['calls_per_s'] * blocks_per_call:,.0f} blocks sealed/s")
    print(f"  subscriber  {got['events_per_s']:,.0f} block events/s ({got['events']:,} in {got['messages']:,} "
          f"messages, {got['elapsed_s']:.2f} s)")
    print(f"  lost        {got['gaps']} gaps in the sequence numbers (0: none lost)")
    print(f"  index       {got['num_blocks']:,} blocks; equal to the server's cache: {got['equal']}")
    if not got["equal"] or got["gaps"]:
        raise SystemExit("the subscriber lost events or its index differs from the server's")


def latencies(address: str, num_seqs: int, steps: int) -> np.ndarray:
    """Decode-like: every call appends one token (with its id) to each of ``num_seqs`` sequences; seconds a call."""
    rng = np.random.default_rng(1)
    out = np.empty(steps)
    with grpc.insecure_channel(address, options=OPTIONS) as channel:
        stub = pb_grpc.KVPoolServiceStub(channel)
        seqs = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(num_seqs)]
        for i in range(steps):
            token_ids = rng.integers(0, 1 << 31, num_seqs, dtype=np.uint32).tolist()
            started = time.perf_counter()
            stub.AppendToken(pb.AppendTokenRequest(seq_ids=seqs, num_tokens=[1], token_ids=token_ids))
            out[i] = time.perf_counter() - started
        stub.Free(pb.FreeRequest(seq_ids=seqs))
    return out


def latency(args: argparse.Namespace) -> None:
    figures = {}
    for label in ("off", "on"):
        ipc = tempfile.mkdtemp(prefix="kvz-", dir="/tmp")
        flags = ["--kv-events-publish", f"ipc://{ipc}/pub", "--kv-events-model", MODEL] if label == "on" else []
        server = Server("kvpool", ["--num-blocks", str(args.num_blocks), *flags], transport="unix")
        try:
            times = latencies(server.address, args.latency_seqs, args.latency_steps)
        finally:
            server.stop()
        figures[label] = (np.percentile(times, 50) * 1e6, np.percentile(times, 99) * 1e6)
    print(f"AppendToken, {args.latency_seqs} sequences x 1 token with ids, {args.latency_steps} calls (no subscriber):")
    for label, (p50, p99) in figures.items():
        print(f"  publisher {label:3s}  p50 {p50:8.1f} us  p99 {p99:8.1f} us")
    print(f"  p99 on/off  {figures['on'][1] / figures['off'][1]:.2f}x (target <= 1.1x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    driver_arguments(parser)
    parser.add_argument("--latency-seqs", type=int, default=64)
    parser.add_argument("--latency-steps", type=int, default=2000, help="AppendToken calls timed per server")
    args = parser.parse_args()
    throughput(args)
    latency(args)


if __name__ == "__main__":
    main()
