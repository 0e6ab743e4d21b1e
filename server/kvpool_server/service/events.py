"""SubscribeEvents: the prefix cache's KV events (``core.kv_events.KVEventLog``) as a server-streaming RPC.

The log is filled under the servicer's lock by the appends (sealing stores blocks, allocation evicts them) and
published once per append (``EventFeed.publish``), which wakes every subscriber. A subscriber gets a snapshot
first -- unless ``from_seq`` resumes within the buffer -- then each batch in order; one that falls behind the
bounded buffer gets a fresh snapshot (its ``num_dropped`` says so). Subscribers are not ``streams.OpenStreams``
entries: they are idle by design (no events, no progress), so the idle sweep must not end them; they end when the
client cancels or the server drains (checked every ``POLL_S``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventLog
from kvpool_server.core.prefix_cache import PrefixCache
from kvpool_server.errors import TooManyStreamsError, trailing_metadata_of
from kvpool_server.handlers import CallContext, error_status, parse_request

RPC = "SubscribeEvents"
POLL_S = 0.5


class EventFeed:
    """The servicer's event log and the wake-up of its subscribers."""

    def __init__(self, epoch: int, cache: PrefixCache, capacity: int = 10_000, medium: str = "",
                 max_subscribers: int = 64) -> None:
        self.log = KVEventLog(epoch, capacity)
        self.log.attach(cache)
        self.cache = cache
        self.medium = medium  # "GPU" or "CPU": where the pool is (vLLM's kv_events field)
        self.max_subscribers = max_subscribers  # --max-event-subscribers
        self.num_subscribers = 0  # open SubscribeEvents streams (on the loop thread only)
        self._published: asyncio.Event | None = None  # made on the loop, on first use

    def publish(self) -> None:
        """After a mutation, under the lock, on the loop thread: close its events into a batch, wake subscribers."""
        if self.log.pending and self.log.publish() is not None and self._published is not None:
            self._published.set()
            self._published = None

    def waiter(self) -> asyncio.Event:
        if self._published is None:
            self._published = asyncio.Event()
        return self._published


def batch_message(batch: EventBatch, num_dropped: int, medium: str = "") -> pb.SubscribeEventsResponse:
    events = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(pb.KVEvent(block_stored=pb.BlockStored(
                block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash or b"",
                token_ids=event.token_ids, block_size=event.block_size, cache_extra_key=event.cache_extra_key,
                medium=medium)))
        elif isinstance(event, BlockRemoved):
            events.append(pb.KVEvent(block_removed=pb.BlockRemoved(block_hashes=event.block_hashes, medium=medium)))
        elif isinstance(event, AllBlocksCleared):
            events.append(pb.KVEvent(all_blocks_cleared=pb.AllBlocksCleared()))
    return pb.SubscribeEventsResponse(epoch=batch.epoch, seq=batch.seq, events=events, snapshot=batch.snapshot,
                                      num_dropped=num_dropped)


def events_handler(call: CallContext, servicer: Any) -> grpc.RpcMethodHandler:
    """SubscribeEvents as a unary-stream handler of raw bytes."""
    drain = call.drain

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> None:
        started, code_name = time.perf_counter(), "OK"
        feed: EventFeed = servicer.events
        subscribed = False
        try:
            if call.auth is not None:
                call.authenticate(context, RPC)
            request = parse_request(pb.SubscribeEventsRequest, raw, RPC)
            if drain.draining:
                drain.refuse()
            if feed.num_subscribers >= feed.max_subscribers:
                raise TooManyStreamsError(
                    f"kvpool-server already has {feed.num_subscribers} SubscribeEvents streams open, its limit "
                    f"(--max-event-subscribers={feed.max_subscribers}, KVPOOL_MAX_EVENT_SUBSCRIBERS): close one, "
                    "or raise the limit")
            feed.num_subscribers += 1
            subscribed = True
            next_seq = request.from_seq if request.HasField("from_seq") else -1
            if request.HasField("epoch") and request.epoch != feed.log.epoch:
                next_seq = -1  # from_seq numbers another start's batches
            while not drain.draining:
                waiter = feed.waiter()
                with servicer.lock:
                    batches = feed.log.since(next_seq) if next_seq >= 0 else None
                    if batches is None:
                        batches = [feed.log.snapshot(feed.cache)]
                    num_dropped = feed.log.num_dropped
                for batch in batches:
                    await context.write(batch_message(batch, num_dropped, feed.medium).SerializeToString())
                    next_seq = batch.seq + 1
                if next_seq < 0:
                    next_seq = feed.log.next_seq
                try:
                    await asyncio.wait_for(waiter.wait(), POLL_S)
                except asyncio.TimeoutError:
                    pass
        except asyncio.CancelledError:
            code_name = "CANCELLED"
            raise
        except Exception as exc:
            code, message = error_status(exc, RPC)
            code_name = code.name
            await context.abort(code, message, trailing_metadata_of(exc))
        finally:
            if subscribed:
                feed.num_subscribers -= 1
            if call.metrics is not None:
                call.metrics.observe_rpc(RPC, code_name, time.perf_counter() - started)

    return grpc.unary_stream_rpc_method_handler(handle)
