"""``kvctl events --zmq ENDPOINT``: follow a server's KV events on vLLM's ZMQ wire (--kv-events-publish,
docs/scale-out.md) for debugging, as a router sees them: one line per event, or (``--json``) one JSON object per
message. ``--replay ENDPOINT`` with ``--from-seq N`` first asks the ROUTER socket for the kept messages from N.
Decodes both msgpack layouts (array and map). Needs pyzmq and msgpack (imported only here)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqUnavailable(RuntimeError):
    """pyzmq or msgpack is not installed."""


def decode(payload: bytes) -> dict:
    """A batch of either layout as {"ts", "events": [{"type", fields...}], "data_parallel_rank"}."""
    import msgpack  # type: ignore[import-untyped]

    batch = msgpack.unpackb(payload)
    if isinstance(batch, list):  # the array layout: [ts, events, dp_rank]; each event [tag, fields...]
        ts, events = batch[0], batch[1]
        rank = batch[2] if len(batch) > 2 else None
        events = [{"type": e[0], **dict(zip(FIELDS.get(e[0], ()), e[1:], strict=False))} for e in events]
        return {"ts": ts, "events": events, "data_parallel_rank": rank}
    return batch  # the map layout is already this shape


def _line(topic: str, seq: int, event: dict) -> str:
    hashes = " ".join(f"{h:016x}" for h in event.get("block_hashes", []))
    extra = ""
    if event["type"] == "BlockStored":
        parent = event.get("parent_block_hash")
        extra = f" parent {parent:016x}" if parent is not None else " parent -"
        extra += f" {len(event.get('token_ids', []))} tokens"
    return f"{seq} {topic} {event['type']} {hashes}{extra}"


def follow(args: argparse.Namespace) -> tuple[dict, str]:
    try:
        import zmq
    except ImportError:
        raise ZmqUnavailable("kvctl events --zmq needs pyzmq and msgpack: pip install pyzmq msgpack") from None
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, (args.topic or "").encode())
    sub.connect(args.zmq)
    messages = events = 0
    last_seq = -1

    def show(topic: str, seq: int, payload: bytes) -> None:
        nonlocal messages, events, last_seq
        batch = decode(payload)
        messages += 1
        events += len(batch["events"])
        last_seq = seq
        if args.json:
            print(json.dumps({"topic": topic, "seq": seq, **batch}, default=_json_default), flush=True)
        else:
            for event in batch["events"]:
                print(_line(topic, seq, event), flush=True)

    try:
        if args.replay and args.from_seq is not None:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(args.replay)
            request = [b"", args.from_seq.to_bytes(8, "big")] + ([args.topic.encode()] if args.topic else [])
            dealer.send_multipart(request)
            while dealer.poll(int(args.timeout * 1000)):
                _, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    break
                show(args.topic or "(replay)", int.from_bytes(seq, "big"), payload)
            dealer.close(0)
        deadline = time.monotonic() + args.seconds if args.seconds else None
        while not (args.batches and messages >= args.batches):
            wait_s = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if wait_s <= 0:
                break
            if sub.poll(int(wait_s * 1000)):
                topic, seq, payload = sub.recv_multipart()
                show(topic.decode(errors="replace"), int.from_bytes(seq, "big"), payload)
    finally:
        sub.close(0)
        ctx.term()
    data = {"messages": messages, "events": events, "last_seq": last_seq}
    return data, f"{messages} messages, {events} events (last seq {last_seq}; replay from {last_seq + 1})"


def _json_default(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else str(value)
