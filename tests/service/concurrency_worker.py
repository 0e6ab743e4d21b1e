"""One client process of test_service_concurrency: random register / append / fork / free against a shared server.

Every token a client appends gets KV that only it could have written (``token_kv`` of a per-sequence tag), written
right after the append, so a block handed to two sequences that should not share it shows up as wrong bytes on a
later ReadKV. Kept apart from the test module so spawned children import only this.
"""

from __future__ import annotations

import random
import traceback
from typing import Any

import grpc
import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from tests.service.service_helpers import connect, token_kv

MAX_SEQ_LEN = 512
MAX_LIVE = 10


class Client:
    def __init__(self, stub: Any, index: int, seed: int) -> None:
        self.stub = stub
        self.index = index
        self.rng = random.Random(seed)
        self.kv: dict[int, np.ndarray] = {}  # seq_id -> expected KV of every token
        self.tag: dict[int, int] = {}  # seq_id -> the tag its own tokens are written with
        self.family: dict[int, str] = {}  # seq_id -> the sequence it descends from (sharing is allowed within)
        self.num_tags = 0
        self.counts = {"appends": 0, "copies": 0, "exhausted": 0, "forks": 0, "frees": 0, "verified": 0}

    def new_tag(self) -> int:
        self.num_tags += 1
        return self.index * 100_000 + self.num_tags

    # ------------------------------------------------------------------ operations
    def register(self) -> None:
        for _ in range(self.rng.randint(1, 3)):
            seq_id = self.stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
            assert seq_id not in self.kv
            self.kv[seq_id] = token_kv(0, [])
            self.tag[seq_id] = self.new_tag()
            self.family[seq_id] = f"{self.index}:{seq_id}"

    def append(self) -> None:
        candidates = [s for s in self.kv if len(self.kv[s]) < MAX_SEQ_LEN]
        if not candidates:
            return
        seq_ids = self.rng.sample(candidates, self.rng.randint(1, min(6, len(candidates))))
        counts = [self.rng.randint(1, min(40, MAX_SEQ_LEN - len(self.kv[s]))) for s in seq_ids]
        lengths = {s: len(self.kv[s]) for s in seq_ids}
        try:
            reply = self.stub.AppendToken(pb.AppendTokenRequest(seq_ids=seq_ids, num_tokens=counts))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            self.counts["exhausted"] += 1
            for s in seq_ids:  # all or nothing: no sequence grew
                assert self.stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=s)).num_tokens == lengths[s]
            self.free(prefer_long=True)
            return
        self.counts["appends"] += 1
        self.counts["copies"] += len(reply.copies)
        assert len(reply.slot_mapping) == sum(counts) == len(set(reply.slot_mapping))
        for s, n in zip(seq_ids, counts):
            start = lengths[s]
            new = token_kv(self.tag[s], range(start, start + n))
            self.stub.WriteKV(pb.WriteKVRequest(seq_id=s, start_position=start, data=new.tobytes()))
            self.kv[s] = np.concatenate([self.kv[s], new])

    def fork(self) -> None:
        parents = [s for s in self.kv if len(self.kv[s]) > 0]
        if not parents:
            return
        parent = self.rng.choice(parents)
        try:
            children = self.stub.Fork(
                pb.ForkRequest(parent_seq_id=parent, num_children=self.rng.randint(1, 2))
            ).child_seq_ids
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            self.counts["exhausted"] += 1
            return
        self.counts["forks"] += 1
        for child in children:
            self.kv[child] = self.kv[parent].copy()
            self.tag[child] = self.new_tag()
            self.family[child] = self.family[parent]

    def free(self, prefer_long: bool = False) -> None:
        if not self.kv:
            return
        if prefer_long:
            seq_ids = [max(self.kv, key=lambda s: len(self.kv[s]))]
        else:
            seq_ids = self.rng.sample(list(self.kv), self.rng.randint(1, min(2, len(self.kv))))
        self.stub.Free(pb.FreeRequest(seq_ids=seq_ids))
        self.counts["frees"] += 1
        for s in seq_ids:
            del self.kv[s], self.tag[s], self.family[s]

    def verify(self, seq_ids: list[int] | None = None) -> None:
        for s in seq_ids if seq_ids is not None else list(self.kv):
            expected = self.kv[s]
            reply = self.stub.ReadKV(pb.ReadKVRequest(seq_id=s))
            assert reply.num_tokens == len(expected), (s, reply.num_tokens, len(expected))
            assert reply.data == expected.tobytes(), f"KV of sequence {s} was overwritten"
            self.counts["verified"] += 1

    def step(self) -> None:
        if len(self.kv) >= MAX_LIVE:
            self.free()
        op = self.rng.choices(["register", "append", "fork", "free", "verify"], weights=[2, 5, 2, 1, 1])[0]
        if op == "verify":
            self.verify(self.rng.sample(list(self.kv), min(3, len(self.kv))))
        else:
            getattr(self, op)()

    def tables(self) -> dict[int, tuple[str, list[int], int]]:
        out = {}
        for s in self.kv:
            table = self.stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=s))
            out[s] = (self.family[s], list(table.block_ids), table.num_tokens)
        return out


def run_worker(address: str, index: int, seed: int, num_steps: int, barrier: Any, results: Any) -> None:
    """Phase 1: random operations. Barrier. Phase 2: verify all KV, report block tables. Barrier. Free everything."""
    try:
        with connect(address) as stub:
            client = Client(stub, index, seed)
            try:
                for _ in range(num_steps):
                    client.step()
            finally:
                barrier.wait(timeout=120)
            client.verify()
            results.put(("tables", index, client.tables(), client.counts))
            barrier.wait(timeout=120)
            if client.kv:
                stub.Free(pb.FreeRequest(seq_ids=list(client.kv)))
            results.put(("done", index, None, None))
    except BaseException:
        results.put(("error", index, traceback.format_exc(), None))
