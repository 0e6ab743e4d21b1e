"""A consumer of kvpool's KV events written to vLLM's contract, not to kvpool's code (docs/scale-out.md).

Two decoders of the payload:

* ``decode_like_llmd``: msgpack only, as llm-d's Go adapter (pkg/kvevents/engineadapter/vllm_adapter.go) does it --
  the batch is an array ``[ts, events, data_parallel_rank]``; each event an array whose first element is its tag;
  BlockStored's fields by position ``[tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]``; hashes as u64 (or bytes: their last 8, big-endian); the topic split on "@" into 3 parts.
* ``decode_like_vllm``: msgspec structs with vLLM's schema (vllm/distributed/kv_events.py), in either layout:
  ``array_like=True`` (the older vLLM's and the example subscriber's) or the map layout of the newest vLLM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class Message:
    topic: bytes
    seq: int
    payload: bytes

    @property
    def pod_and_model(self) -> tuple[str, str]:
        parts = self.topic.decode().split("@")  # llm-d: exactly 3 parts, else the whole topic is the pod
        assert len(parts) == 3 and parts[0] == "kv", self.topic
        return parts[1], parts[2]


def as_u64(raw: Any) -> int:
    """llm-d's getHashAsUint64: an int (u64, or i64 read as its two's complement) or bytes (the last 8)."""
    if isinstance(raw, int):
        return raw & (2**64 - 1)
    assert isinstance(raw, bytes) and raw
    return int.from_bytes(raw[-8:].rjust(8, b"\0"), "big")


def decode_like_llmd(payload: bytes) -> list[tuple]:
    """(tag, ...) per event: ("BlockStored", hashes, parent or 0, tokens, block_size, medium), ("BlockRemoved",
    hashes, medium), ("AllBlocksCleared",)."""
    batch = msgpack.unpackb(payload)
    assert isinstance(batch, list) and 2 <= len(batch) <= 3, batch
    ts, events = batch[0], batch[1]
    assert isinstance(ts, float) and abs(ts - time.time()) < 3600
    out: list[tuple] = []
    for raw in events:
        assert isinstance(raw, list) and isinstance(raw[0], str), raw
        if raw[0] == "BlockStored":
            hashes, parent, tokens, block_size = raw[1], raw[2], raw[3], raw[4]
            medium = raw[6] if len(raw) > 6 else None
            out.append(("BlockStored", [as_u64(h) for h in hashes], 0 if parent is None else as_u64(parent),
                        list(tokens), int(block_size), medium))
        elif raw[0] == "BlockRemoved":
            out.append(("BlockRemoved", [as_u64(h) for h in raw[1]], raw[2] if len(raw) > 2 else None))
        elif raw[0] == "AllBlocksCleared":
            out.append(("AllBlocksCleared",))
        else:
            raise AssertionError(f"unknown vLLM event tag {raw[0]!r}")
    return out


def decode_like_vllm(payload: bytes, array_like: bool = True) -> Any:
    """The payload decoded by msgspec with vLLM's structs (vllm_schema.py) in one layout; raises if it does not
    fit them."""
    import msgspec

    from tests.zmq_events import vllm_schema

    batch_type = vllm_schema.ArrayKVEventBatch if array_like else vllm_schema.MapKVEventBatch
    return msgspec.msgpack.Decoder(batch_type).decode(payload)


class Subscriber:
    """A ZMQ SUB socket on ``endpoint`` (every topic unless ``topic``), and replay requests on ``replay``."""

    def __init__(self, endpoint: str, replay: str = "", topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        time.sleep(0.3)  # ZMQ's slow joiner: the subscription reaches the publisher

    def recv(self, timeout_s: float = 5.0) -> Message | None:
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert len(seq) == 8
        return Message(topic, int.from_bytes(seq, "big"), payload)

    def recv_all(self, quiet_s: float = 0.5) -> list[Message]:
        """Every message until none came for ``quiet_s``."""
        messages = []
        while (message := self.recv(quiet_s)) is not None:
            messages.append(message)
        return messages

    def replay(self, start_seq: int, topic: bytes | None = None) -> list[tuple[int, bytes]]:
        """vLLM's replay request from a DEALER (what a REQ-like client sends to the ROUTER): (seq, payload)..."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")] + ([topic] if topic is not None else []))
        out = []
        try:
            while True:
                assert dealer.poll(5000), "no replay answer"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(0)

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


class Index:
    """A router's view of one topic, from the decoded events alone: engine key -> (parent key or 0, token ids)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.num_unknown_removed = 0
        self.num_missing_parent = 0

    def apply(self, events: list[tuple]) -> None:
        for event in events:
            if event[0] == "AllBlocksCleared":
                self.blocks.clear()
            elif event[0] == "BlockStored":
                _, hashes, parent, tokens, block_size, _ = event
                assert len(tokens) == block_size * len(hashes)
                if parent and parent not in self.blocks:
                    self.num_missing_parent += 1  # llm-d would skip this event
                for i, h in enumerate(hashes):
                    self.blocks[h] = (parent, tuple(tokens[i * block_size: (i + 1) * block_size]))
                    parent = h
            elif event[0] == "BlockRemoved":
                for h in event[1]:
                    if self.blocks.pop(h, None) is None:
                        self.num_unknown_removed += 1
