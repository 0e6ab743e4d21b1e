"""KV events benchmark: how many block events a second reach a SubscribeEvents subscriber, and whether any are lost.

A real ``kvpool-server`` process (host pool, unix socket, 16-token blocks) and two client processes:

  driver      this process: ``--seqs`` sequences, each AppendToken call adds ``--tokens-per-call`` tokens to every
              one of them with their token ids, so that each call seals the blocks the previous call filled
              (64 x 256 tokens: 1,024 blocks a call, each a BlockStored hash). A sequence that reaches
              ``--max-seq-len`` is freed (its blocks stay cached) and a new one takes its place; once the pool is
              full of cached blocks every allocation evicts (BlockRemoved hashes) as many as it seals.
  subscriber  a separate process running ``EventFollower``: subscribes (a snapshot first), applies every batch
              into its ``EventIndex``, counts block events (each hash in a BlockStored or BlockRemoved is one) and
              the snapshots it had to take (a subscriber that falls behind the server's buffer gets one: the
              batches it missed are the dropped ones). At the end it waits for the last batch and checks that its
              index equals a fresh subscriber's snapshot.

Printed: block events/s at the subscriber (first to last live batch), the driver's calls/s and blocks sealed/s,
the subscriber's re-snapshots (0: nothing dropped for it), the server's ``num_dropped`` (batches that left its
bounded buffer -- with or without a subscriber behind), and whether the indexes are equal.
Run: ``.venv/bin/python benchmarks/bench_events.py`` (``make bench-events``); ``--seconds 2`` for a short run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import grpc
import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

from bench_service_servers import Server  # this directory

OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


def subscriber(address: str, ready, target, results) -> None:  # type: ignore[no-untyped-def]
    """Follow the events until the batch ``target`` names (epoch, seq) is applied; put the figures in ``results``."""
    import threading

    from kvpool_client import EventFollower, KVPoolClient, fetch_snapshot

    with KVPoolClient(address, session=False, timeout=60) as client:
        follower = EventFollower(client)
        timing = {"first": 0.0, "last": 0.0, "live_events": 0, "num_dropped": 0}

        def follow() -> None:
            seen = 0
            for batch in follower.batches():
                total = follower.index.counts.num_block_events
                if not batch.snapshot:
                    timing["first"] = timing["first"] or time.perf_counter()
                    timing["last"] = time.perf_counter()
                    timing["live_events"] += total - seen
                else:
                    ready.set()
                timing["num_dropped"] = batch.num_dropped
                seen = total

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        epoch, seq = target.get()
        caught_up = follower.wait_until(epoch, seq, timeout=300)
        equal = caught_up and follower.blocks() == fetch_snapshot(client, timeout=60).blocks
        counts = follower.index.counts
        follower.close()
    elapsed = max(timing["last"] - timing["first"], 1e-9)
    results.put({"events_per_s": timing["live_events"] / elapsed, "live_events": timing["live_events"],
                 "elapsed_s": elapsed, "snapshots": counts.num_snapshots, "num_dropped": timing["num_dropped"],
                 "stored": counts.num_blocks_stored, "removed": counts.num_blocks_removed,
                 "equal": equal, "caught_up": caught_up, "num_blocks": len(follower.index)})


def drive(stub: pb_grpc.KVPoolServiceStub, seconds: float, num_seqs: int, tokens_per_call: int,
          max_seq_len: int) -> dict:
    """Append with token ids as fast as the server answers, for ``seconds``; free and renew full sequences."""
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 1 << 31, num_seqs * tokens_per_call, dtype=np.uint32).tolist() for _ in range(8)]
    calls = tokens = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        seqs = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(num_seqs)]
        first = rng.integers(0, 1 << 31, num_seqs * tokens_per_call, dtype=np.uint32).tolist()  # unique prefixes
        for step in range(max_seq_len // tokens_per_call):
            token_ids = first if step == 0 else chunks[step % len(chunks)]
            stub.AppendToken(pb.AppendTokenRequest(seq_ids=seqs, num_tokens=[tokens_per_call], token_ids=token_ids))
            calls += 1
            tokens += len(token_ids)
            if time.perf_counter() - started >= seconds:
                break
        stub.Free(pb.FreeRequest(seq_ids=seqs))
    elapsed = time.perf_counter() - started
    return {"calls_per_s": calls / elapsed, "tokens_per_s": tokens / elapsed, "calls": calls, "elapsed_s": elapsed}


def driver_arguments(parser: argparse.ArgumentParser) -> None:
    """The driver's flags (this benchmark's and bench_zmq_events.py's)."""
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the driver appends")
    parser.add_argument("--seqs", type=int, default=64, help="sequences appended to in each call")
    parser.add_argument("--tokens-per-call", type=int, default=256, help="tokens added to each sequence a call")
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--num-blocks", type=int, default=32768, help="pool size (fills, then evicts)")
    parser.add_argument("--block-size", type=int, default=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    driver_arguments(parser)
    args = parser.parse_args()

    server = Server("kvpool", ["--num-blocks", str(args.num_blocks), "--max-seq-len", str(args.max_seq_len),
                               "--block-size", str(args.block_size)], transport="unix")
    ctx = mp.get_context("spawn")
    ready, target, results = ctx.Event(), ctx.Queue(), ctx.Queue()
    sub = ctx.Process(target=subscriber, args=(server.address, ready, target, results), daemon=True)
    try:
        sub.start()
        if not ready.wait(60):
            raise RuntimeError("the subscriber got no snapshot")
        with grpc.insecure_channel(server.address, options=OPTIONS) as channel:
            stub = pb_grpc.KVPoolServiceStub(channel)
            driven = drive(stub, args.seconds, args.seqs, args.tokens_per_call, args.max_seq_len)
            stats = stub.Stats(pb.StatsRequest())
            last = next(iter(stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=60)))  # a snapshot
            target.put((last.epoch, last.seq))
        got = results.get(timeout=600)
        sub.join(30)
    finally:
        server.stop()
    blocks_per_call = args.seqs * args.tokens_per_call // args.block_size
    print(f"kvpool KV events: {args.seqs} sequences x {args.tokens_per_call} tokens a call ({blocks_per_call} blocks "
          f"sealed a call), block size {args.block_size}, pool {args.num_blocks} blocks, {args.seconds:g} s")
    print(f"  driver      {driven['calls_per_s']:8.1f} AppendToken calls/s, {driven['tokens_per_s'] / 1e6:.2f} M "
          f"tokens/s, {driven['calls_per_s'] * blocks_per_call:,.0f} blocks sealed/s")
    print(f"  subscriber  {got['events_per_s']:,.0f} block events/s ({got['live_events']:,} in {got['elapsed_s']:.2f} "
          f"s: {got['stored']:,} stored, {got['removed']:,} removed, snapshots included)")
    print(f"  dropped     {got['snapshots'] - 1} re-snapshots at the subscriber (0: it missed nothing); the "
          f"server's buffer dropped {got['num_dropped']} batches")
    print(f"  evictions   {stats.num_blocks_evictable} blocks evictable at the end")
    print(f"  index       {got['num_blocks']:,} blocks; equal to a fresh snapshot: {got['equal']} "
          f"(caught up: {got['caught_up']})")
    if not got["equal"]:
        raise SystemExit("the subscriber's index differs from the server's")


if __name__ == "__main__":
    main()
