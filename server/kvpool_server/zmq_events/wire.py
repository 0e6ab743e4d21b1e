"""vLLM's KV-event wire: what kvpool's events become on a ZMQ PUB socket (docs/scale-out.md).

Each message is three frames, as vllm/distributed/kv_events.py's ZmqEventPublisher sends them::

    topic            b"kv@<pod>@<model>"      (llm-d's indexer reads the pod and the model name from it; with
                                             several pod names, each message is sent under each)
    sequence number  8 bytes, big-endian      (one counter for the socket; never lower than an earlier start's)
    payload          msgpack of an event batch

The payload is vLLM's ``KVEventBatch`` as msgspec encodes it, in one of two layouts (``--kv-events-layout``):

* ``array`` (msgspec ``array_like=True``; the default: what llm-d's Go adapter and Dynamo's ZMQ listener decode)::

      [ts, [event, ...], data_parallel_rank]
      ["BlockStored", [hash, ...], parent_hash | nil, [token_id, ...], block_size, lora_id=nil, medium, lora_name=nil]
      ["BlockRemoved", [hash, ...], medium]
      ["AllBlocksCleared"]

* ``map`` (the newest vLLM, without ``array_like``): ``{"ts": ..., "events": [...], "data_parallel_rank": 0}``, each
  event ``{"type": "BlockStored", "block_hashes": ..., "parent_block_hash": ..., ...}`` with the same fields.

Hashes are 64-bit unsigned ints (vLLM sends the low 64 bits of its sha256; llm-d and Dynamo read u64): kvpool's
are the last 8 bytes of its 32-byte block hash, big-endian, XOR the model name's mask (``model_mask``), so that a
public block published under two model names is two engine keys (llm-d maps an engine key to one request key,
which includes the model name). The same block under the same model name has the same key on every host.

Tenants (``TopicMap``): neither consumer salts its keys, so each tenant's blocks go under a model name of its own
(its topic); a tenant without one is not published. Public blocks (a public prefix's: every tenant may hold them)
go under every topic. Blocks with a cache_extra_key (a LoRA adapter, multimodal inputs) are not published: a
router keying blocks by token ids alone would score them for requests without that key.

``WireEvents`` keeps which blocks it published under which salt (a dict, at most one entry per cached block of
the pool: ~120 bytes each by tracemalloc) to send each BlockRemoved to the topics that saw the block stored, and only those.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool_server.core.block_hash import PUBLIC_SALT
from kvpool_server.core.kv_event_types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

LAYOUTS = ("array", "map")
MASK_DOMAIN = b"kvpool.kv-events.v1\x00"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker (vLLM's)
DATA_PARALLEL_RANK = 0
# vLLM's field order (msgspec's array layout follows the struct's field order; the tag comes first).
FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
WireEvent = tuple[Any, ...]  # (tag, field values in FIELDS' order)


def model_mask(model: str) -> int:
    """The 64-bit mask of a model name's engine keys: the first 8 bytes of sha256(MASK_DOMAIN || model)."""
    return int.from_bytes(hashlib.sha256(MASK_DOMAIN + model.encode()).digest()[:8], "big")


def engine_hash(block_hash: bytes, mask: int) -> int:
    """A kvpool block hash as the 64-bit int published under a model whose mask is ``mask``."""
    return int.from_bytes(block_hash[-8:], "big") ^ mask


@dataclass(frozen=True, eq=False)
class Topic:
    """A model name's topics: ``kv@<pod>@<model>`` for each pod name (the same messages under each)."""

    model: str
    names: tuple[bytes, ...]
    mask: int  # model_mask(model)


class TopicMap:
    """Which topics a block of a given salt is published under: its tenant's (``models``: salt -> model name; the
    salt is the tenant's name, b"" without authentication), or every topic for a public block. Each model name is
    published under every pod name of ``pods`` (the frontends a router knows this host's pool by)."""

    def __init__(self, pods: str | list[str], models: Mapping[bytes, str]) -> None:
        pods = [pods] if isinstance(pods, str) else pods
        self.of_tenant: dict[bytes, Topic] = {
            salt: Topic(model, tuple(f"kv@{pod}@{model}".encode() for pod in pods), model_mask(model))
            for salt, model in models.items()}
        self.topics: list[Topic] = list(self.of_tenant.values())

    def of_salt(self, salt: bytes) -> list[Topic]:
        if salt == PUBLIC_SALT:
            return self.topics
        topic = self.of_tenant.get(salt)
        return [topic] if topic is not None else []


class WireEvents:
    """kvpool's events, split by topic, as vLLM's events (``translate``). Keeps ``published``: kvpool hash -> the
    salt it was published under, for every block stored on the wire and not yet removed."""

    def __init__(self, topics: TopicMap, medium: str) -> None:
        self.topics = topics
        self.medium = medium
        self.published: dict[bytes, bytes] = {}
        self.num_withheld = 0  # blocks stored and not published (an extra key, or a tenant without a model name)

    def translate(self, events: Iterable[KVEvent]) -> dict[Topic, list[WireEvent]]:
        out: dict[Topic, list[WireEvent]] = {}
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event, out)
            elif isinstance(event, BlockRemoved):
                self._removed(event, out)
            elif isinstance(event, AllBlocksCleared):
                self.published.clear()
                for topic in self.topics.topics:
                    out.setdefault(topic, []).append(("AllBlocksCleared",))
        return out

    def _stored(self, event: BlockStored, out: dict[Topic, list[WireEvent]]) -> None:
        topics = [] if event.cache_extra_key else self.topics.of_salt(event.salt)
        if not topics:
            self.num_withheld += len(event.block_hashes)
            return
        tokens = event.token_ids.tolist()
        for h in event.block_hashes:
            self.published[h] = event.salt
        for topic in topics:
            parent = None if event.parent_block_hash is None else engine_hash(event.parent_block_hash, topic.mask)
            out.setdefault(topic, []).append((
                "BlockStored", [engine_hash(h, topic.mask) for h in event.block_hashes], parent, tokens,
                event.block_size, None, self.medium, None))

    def _removed(self, event: BlockRemoved, out: dict[Topic, list[WireEvent]]) -> None:
        by_salt: dict[bytes, list[bytes]] = {}
        for h in event.block_hashes:
            salt = self.published.pop(h, None)
            if salt is not None:
                by_salt.setdefault(salt, []).append(h)
        for salt, hashes in by_salt.items():
            for topic in self.topics.of_salt(salt):
                out.setdefault(topic, []).append(
                    ("BlockRemoved", [engine_hash(h, topic.mask) for h in hashes], self.medium))


def batch_object(ts: float, events: list[WireEvent], layout: str) -> Any:
    """The batch as msgspec would lay it out (before msgpack): a list (``array``) or a dict (``map``)."""
    if layout == "array":
        return [ts, events, DATA_PARALLEL_RANK]
    return {"ts": ts, "events": [{"type": e[0], **dict(zip(FIELDS[e[0]], e[1:], strict=True))} for e in events],
            "data_parallel_rank": DATA_PARALLEL_RANK}
