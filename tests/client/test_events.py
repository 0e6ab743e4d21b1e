"""EventFollower against a real server process: while a prefix-caching workload runs (prompts that share prefixes,
appends with token ids that seal blocks, frees, eviction under pool pressure), the follower's index ends equal
to the server's (a fresh subscriber's snapshot, and the live sequences' GetBlockTable.block_hashes) -- also after
a disconnect resumed with from_seq, after falling behind the event buffer (a snapshot), and across a server
restart (a new epoch: the snapshot of the new server)."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import (
    AsyncEventFollower,
    AsyncKVPoolClient,
    EventFollower,
    EventIndex,
    KVPoolClient,
    ResourceExhaustedError,
    fetch_snapshot,
)
from tests.conftest import start_server

BLOCK_SIZE = 16
SMALL_POOL = ("--num-blocks", "48")  # the workload holds more than this: cached blocks get evicted


class Workload:
    """Sequences registered with prompts from a few shared prefixes, decoded with token ids, freed at random."""

    def __init__(self, client: KVPoolClient, seed: int = 0) -> None:
        self.client = client
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(1000) for _ in range(3 * BLOCK_SIZE)] for _ in range(3)]
        self.live: list[int] = []

    def step(self) -> None:
        rng = self.rng
        if len(self.live) < 6 or rng.random() < 0.3:
            prompt = rng.choice(self.prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
            seq, cached = self.client.register_prompt(prompt)
            self.live.append(seq)
            self._append([seq], prompt[cached:])
        if rng.random() < 0.25:
            self.free(rng.choice(self.live))
        if self.live:
            decoding = rng.sample(self.live, min(len(self.live), 4))
            self._append(decoding, [rng.randrange(1000) for _ in range(rng.randrange(1, 20))])

    def _append(self, seqs: list[int], tokens: list[int]) -> None:
        """Append ``tokens`` to each of ``seqs``; under pressure, free the oldest sequence and give up."""
        try:
            self.client.append(seqs, len(tokens), token_ids=tokens * len(seqs))
        except ResourceExhaustedError:
            self.free(self.live[0])

    def free(self, seq: int) -> None:
        self.live.remove(seq)
        self.client.free(seq)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()


def caught_up(follower, client: KVPoolClient, timeout: float = 20.0) -> EventIndex:
    """The server's index now (a fresh snapshot), once the follower has applied every batch it includes."""
    server_index = fetch_snapshot(client)
    assert follower.wait_until(server_index.epoch, server_index.last_seq, timeout), (
        f"follower at {follower.position()}, server at {server_index.epoch:x}:{server_index.last_seq}")
    return server_index


def check_live_sequences(client: KVPoolClient, live: list[int], blocks: dict) -> None:
    """Every sealed block of a live sequence is in the index, chained to its predecessor."""
    for seq in live:
        hashes = client._stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq)).block_hashes
        parent = b""
        for block_hash in hashes:
            if not block_hash:
                break
            assert blocks[block_hash].parent_hash == parent
            parent = block_hash


def test_a_follower_ends_equal_to_the_server_while_a_workload_runs(server_factory) -> None:
    server = server_factory(*SMALL_POOL)
    with KVPoolClient(server.address, session=False) as client:
        with EventFollower(client) as follower:
            workload = Workload(client)
            workload.run(120)
            server_index = caught_up(follower, client)
            blocks = follower.blocks()
        assert blocks == server_index.blocks and len(blocks) > 0
        counts = follower.index.counts
        assert counts.num_blocks_removed > 0, "no eviction: the pool was not under pressure"
        assert counts.num_snapshots == 1 and counts.num_duplicates == 0 and counts.num_unknown_removed == 0
        check_live_sequences(client, workload.live, blocks)
        client.check_invariants()


def test_a_follower_that_reconnects_resumes_from_seq_or_takes_a_snapshot(server_factory) -> None:
    """Buffer of 8 batches: a short absence resumes (no new snapshot), a long one gets a snapshot."""
    server = server_factory(*SMALL_POOL, "--event-buffer-batches", "8")
    with KVPoolClient(server.address, session=False) as client:
        workload = Workload(client, seed=1)
        index = EventIndex()
        for absence, snapshots in ((2, 1), (60, 2)):
            with EventFollower(client, index) as follower:
                workload.run(10)
                caught_up(follower, client)
            before = index.last_seq
            workload.run(absence)  # changes the follower misses
            assert fetch_snapshot(client).last_seq > before
            with EventFollower(client, index) as follower:  # subscribes with from_seq = before + 1
                server_index = caught_up(follower, client)
            assert index == server_index and index.counts.num_snapshots == snapshots
        assert index.counts.num_unknown_removed == 0
        check_live_sequences(client, workload.live, index.blocks)


def test_a_follower_takes_the_snapshot_of_a_restarted_server(tmp_path: Path) -> None:
    """The same unix socket, a new server process (a new epoch, fewer batches, other blocks): the follower, left
    running, reconnects by itself and ends equal to the new server."""
    socket_dir = tempfile.mkdtemp(prefix="kvp-", dir="/tmp")
    target = f"unix:{os.path.join(socket_dir, 'kvpool.sock')}"
    args = ("--unix-socket", os.path.join(socket_dir, "kvpool.sock"), *SMALL_POOL)
    first = start_server(tmp_path, *args)
    try:
        with KVPoolClient(target, session=False) as client, EventFollower(client) as follower:
            Workload(client, seed=2).run(40)
            old = caught_up(follower, client)
            first.stop()
            second = start_server(tmp_path, *args)
            try:
                client.wait_until_serving(10.0)  # the channel reconnects (it backs off while nobody answers)
                Workload(client, seed=3).run(5)
                new = caught_up(follower, client)
                assert new.epoch != old.epoch and follower.blocks() == new.blocks
                assert follower.num_reconnects >= 1 and follower.index.counts.num_snapshots >= 2
            finally:
                second.stop()
    finally:
        first.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_the_async_follower_follows_too(server) -> None:
    with KVPoolClient(server.address, session=False) as client:
        Workload(client, seed=4).run(20)
        expected = fetch_snapshot(client)

    async def follow() -> EventIndex:
        async with AsyncKVPoolClient(server.address, session=False) as aclient:
            follower = AsyncEventFollower(aclient)
            async for batch in follower.batches():
                if batch.seq >= expected.last_seq:
                    follower.close()
            return follower.index

    index = asyncio.run(asyncio.wait_for(follow(), 20))
    assert index == expected and index.counts.num_snapshots == 1


def test_events_carry_the_extra_key_and_the_medium(server) -> None:
    """A sequence's cache_extra_key (vLLM's lora_id counterpart) and where the pool is ("CPU": the host pool) reach
    the router, and two sequences of the same tokens with different keys are two blocks."""
    prompt = list(range(1, 2 * BLOCK_SIZE + 2))
    with KVPoolClient(server.address, session=False) as client, EventFollower(client) as follower:
        for key in (b"lora-a", b""):
            seq, cached = client.register_prompt(prompt, cache_extra_key=key)
            assert cached == 0
            client.append([seq], len(prompt), token_ids=prompt)
            client.append([seq], 1, token_ids=[7])  # seals the full blocks
        caught_up(follower, client)
        blocks = follower.blocks()
    assert len(blocks) == 4  # 2 full blocks x 2 keys
    assert sorted(b.cache_extra_key for b in blocks.values()) == [b"", b"", b"lora-a", b"lora-a"]
    assert {b.medium for b in blocks.values()} == {"CPU"}


def test_a_from_seq_of_another_epoch_gets_a_snapshot(server) -> None:
    """A router that resumes after the server restarted names the old epoch: the server sends a snapshot, not the
    new start's batches that happen to carry the same numbers."""
    prompt = list(range(1, BLOCK_SIZE + 2))
    with KVPoolClient(server.address, session=False) as client:
        seq, _ = client.register_prompt(prompt)
        client.append([seq], len(prompt), token_ids=prompt)
        client.append([seq], 1, token_ids=[7])  # batch 1 of this epoch: one block sealed
        epoch = fetch_snapshot(client).epoch
        for request_epoch, snapshot in ((epoch, False), (epoch ^ 1, True)):
            stream = client._stub.SubscribeEvents(pb.SubscribeEventsRequest(from_seq=1, epoch=request_epoch),
                                                  timeout=10, metadata=client._metadata)
            first = next(iter(stream))
            stream.cancel()
            assert first.epoch == epoch and first.snapshot is snapshot and (first.seq == 1 or snapshot)


def test_subscribers_beyond_the_limit_are_refused_until_one_leaves(server_factory) -> None:
    """Subscribers are idle by design, so they have their own cap: the third of --max-event-subscribers=2 is
    RESOURCE_EXHAUSTED naming the flag; once one is cancelled a new one is served."""
    server = server_factory("--max-event-subscribers", "2")
    with KVPoolClient(server.address, session=False) as client:
        def subscribe():  # noqa: ANN202
            stream = client._stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=10, metadata=client._metadata)
            return stream, next(iter(stream))  # the snapshot: the server counts it from here

        (first, _), (second, _) = subscribe(), subscribe()
        try:
            subscribe()
            raise AssertionError("a third subscriber was served")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-event-subscribers=2" in error.details()
        first.cancel()
        for _ in range(100):  # the server sees the cancellation
            try:
                third, snapshot = subscribe()
                break
            except grpc.RpcError:
                time.sleep(0.05)
        else:
            raise AssertionError("no subscriber served after one left")
        assert snapshot.snapshot
        third.cancel()
        second.cancel()
        assert client.stats().num_sequences == 0  # the server still serves
