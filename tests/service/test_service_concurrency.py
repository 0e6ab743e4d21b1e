"""Several client processes appending, forking, freeing and writing KV at once against one server.

Checked: every client reads back exactly the KV it wrote (a block shared or reused wrongly would overwrite it); no
block is held by two sequences that do not descend from one another; Stats agrees with the union of all block
tables; CheckInvariants is clean mid-run and at the end; once everything is freed, free == total.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections import defaultdict

from kvpool.v1 import kvpool_pb2 as pb
from tests.service.concurrency_worker import run_worker
from tests.service.service_helpers import connect

NUM_CLIENTS = 4
NUM_STEPS = 120
NUM_BLOCKS = 112


def test_concurrent_clients_never_lose_or_share_blocks_wrongly(server_factory) -> None:
    server = server_factory("--num-blocks", str(NUM_BLOCKS), "--max-seq-len", "512", "--max-num-seqs", "64")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(NUM_CLIENTS + 1)
    results = ctx.Queue()
    workers = [
        ctx.Process(target=run_worker, args=(server.address, i, 1000 + i, NUM_STEPS, barrier, results))
        for i in range(NUM_CLIENTS)
    ]
    for w in workers:
        w.start()
    try:
        barrier.wait(timeout=120)  # phase 1 over: every client stopped mutating
        reports = {}
        while len(reports) < NUM_CLIENTS:
            kind, index, payload, counts = results.get(timeout=120)
            assert kind != "error", f"client {index} failed:\n{payload}"
            reports[index] = (payload, counts)

        with connect(server.address) as stub:
            holders: dict[int, set[str]] = defaultdict(set)
            num_tokens = 0
            num_seqs = 0
            for tables, _ in reports.values():
                for family, block_ids, n in tables.values():
                    assert len(set(block_ids)) == len(block_ids) == -(-n // 16)
                    for block_id in block_ids:
                        holders[block_id].add(family)
                    num_tokens += n
                    num_seqs += 1
            wrongly_shared = {b: f for b, f in holders.items() if len(f) > 1}
            assert not wrongly_shared, f"blocks held by unrelated sequences: {wrongly_shared}"
            stats = stub.Stats(pb.StatsRequest())
            assert stats.num_blocks_used == len(holders)
            assert stats.num_blocks_free == NUM_BLOCKS - len(holders)
            assert (stats.num_sequences, stats.num_tokens) == (num_seqs, num_tokens)
            stub.CheckInvariants(pb.CheckInvariantsRequest())

            totals = defaultdict(int)
            for _, counts in reports.values():
                for key, value in counts.items():
                    totals[key] += value
            # The run did exercise what it claims to: copy-on-write, forks, frees and a full pool.
            assert totals["copies"] > 0 and totals["forks"] > 0 and totals["frees"] > 0, dict(totals)
            assert totals["exhausted"] > 0, dict(totals)

            barrier.wait(timeout=120)  # phase 2 over: clients free everything
            done = 0
            while done < NUM_CLIENTS:
                kind, index, payload, _ = results.get(timeout=120)
                assert kind == "done", f"client {index} failed:\n{payload}"
                done += 1
            stats = stub.Stats(pb.StatsRequest())
            assert (stats.num_blocks_free, stats.num_blocks_total) == (NUM_BLOCKS, NUM_BLOCKS)
            assert (stats.num_sequences, stats.num_tokens, stats.num_blocks_shared) == (0, 0, 0)
            reply = stub.CheckInvariants(pb.CheckInvariantsRequest())
            assert reply.ok and reply.num_sequences_checked == 0
    except (AssertionError, queue.Empty, Exception):
        barrier.abort()
        raise
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    assert all(w.exitcode == 0 for w in workers)
