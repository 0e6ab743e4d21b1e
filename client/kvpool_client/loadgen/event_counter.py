"""EventCounter: a thread in the load generator's driver that follows SubscribeEvents and counts what it consumes.

It reads the raw stream (as ``kvctl events`` does): a snapshot first (AllBlocksCleared + a BlockStored per cached
block), then one batch per append that changed the cache. It counts batches, snapshots and the blocks they list,
BlockStored and BlockRemoved events outside snapshots and their block hashes (blocks sealed and blocks evicted
while it ran), and keeps the set of hashes the stream says are cached -- so that at the end it can be compared with the server (``cached_blocks`` equals the
evictable blocks once no sequence is left).

``stop()`` first catches up: a second, one-message subscription returns a snapshot stamped with the last batch
published, and the counter waits (up to ``catch_up_s``) until it has consumed that batch, then cancels its stream.
Freeing publishes nothing, so after the workers are done that is every event of the run.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_client.credentials import Credentials

MAX_MESSAGE_BYTES = 256 << 20  # a snapshot of a big cache is one message


class EventCounter:
    def __init__(self, target: str, token: str | None = None, catch_up_s: float = 10.0,
                 credentials: Credentials | None = None) -> None:
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self._channel = (credentials or Credentials()).channel(target, options)
        self._stub = pb_grpc.KVPoolServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.catch_up_s = catch_up_s
        self.counts: dict[str, int] = dict.fromkeys(
            ("batches", "snapshots", "snapshot_blocks", "events", "block_stored_events", "blocks_stored",
             "block_removed_events", "blocks_removed", "all_blocks_cleared", "num_dropped"), 0)
        self.cached: set[bytes] = set()  # the hashes the stream says are cached now
        self.epoch = 0
        self.last_seq = 0
        self.error = ""  # why the stream ended early ("" while it runs or when stopped)
        self._stream: Any = None
        self._consumed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvpool-event-counter", daemon=True)
        self._t_first = self._t_last = 0.0

    def start(self) -> EventCounter:
        self._stream = self._stub.SubscribeEvents(pb.SubscribeEventsRequest(), metadata=self._metadata)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for batch in self._stream:
                self._consume(batch)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                self.error = f"{error.code().name}: {error.details()}"
        with self._consumed:
            self._consumed.notify_all()

    def _consume(self, batch: pb.SubscribeEventsResponse) -> None:
        c = self.counts
        c["batches"] += 1
        c["snapshots"] += batch.snapshot
        c["num_dropped"] = batch.num_dropped
        for event in batch.events:
            kind = event.WhichOneof("event")
            c["events"] += 1
            if kind == "block_stored":
                hashes = event.block_stored.block_hashes
                if batch.snapshot:
                    c["snapshot_blocks"] += len(hashes)
                else:
                    c["block_stored_events"] += 1
                    c["blocks_stored"] += len(hashes)
                self.cached.update(hashes)
            elif kind == "block_removed":
                hashes = event.block_removed.block_hashes
                c["block_removed_events"] += 1
                c["blocks_removed"] += len(hashes)
                self.cached.difference_update(hashes)
            elif kind == "all_blocks_cleared":
                c["all_blocks_cleared"] += 1
                self.cached.clear()
        now = time.monotonic()
        self._t_first = self._t_first or now
        self._t_last = now
        with self._consumed:
            self.epoch, self.last_seq = batch.epoch, batch.seq
            self._consumed.notify_all()

    def _server_last_seq(self) -> tuple[int, int]:
        """(epoch, seq of the last batch published) from a fresh subscription's snapshot."""
        stream = self._stub.SubscribeEvents(pb.SubscribeEventsRequest(), metadata=self._metadata,
                                            timeout=self.catch_up_s)
        try:
            first = next(iter(stream))
            return first.epoch, first.seq
        finally:
            stream.cancel()

    def stop(self) -> dict[str, Any]:
        """Catch up with the server, end the stream; returns the summary's ``events`` section."""
        caught_up = False
        if self._thread.is_alive():
            try:
                epoch, seq = self._server_last_seq()
                deadline = time.monotonic() + self.catch_up_s
                with self._consumed:
                    while not (caught_up := self.epoch == epoch and self.last_seq >= seq):
                        if not self._thread.is_alive() or time.monotonic() > deadline:
                            break
                        self._consumed.wait(0.05)
            except grpc.RpcError as error:
                self.error = self.error or f"{error.code().name}: {error.details()}"
            self._stream.cancel()
            self._thread.join(timeout=5)
        self._channel.close()
        return {
            **self.counts,
            "available": not self.error,
            "error": self.error,
            "caught_up": caught_up,
            "epoch": self.epoch,
            "last_seq": self.last_seq,
            "cached_blocks": len(self.cached),
            "stream_s": self._t_last - self._t_first,
        }
