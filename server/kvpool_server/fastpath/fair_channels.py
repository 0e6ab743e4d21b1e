"""FairChannels: the fast-path thread's fair share across sessions (``service.fair``, docs/fast-path.md).

    each pass    the channels in order of their sessions' recent usage, least first (re-sorted every ORDER_S):
                 a flooding session's channel is served after the others'
    a record     its serving time is charged to its session (``charge``)
    a register   of a prompt over CHUNK_BLOCKS blocks: copied out of the segment (header, arrays) and its hashes
                 queued on the hasher (``prompt_hasher``); the channel is skipped -- the thread serves the others
                 -- until the hashes are there (the hasher wakes the thread), then the record is served from that
                 copy with those hashes (``serve_record(prepared=...)``): the client cannot change it meanwhile

Never a wait on the thread. Bounded: at most one ``Prepared`` per live channel (``forget`` when it closes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kvpool import fastpath as fp
from kvpool_server.core.errors import KVPoolError
from kvpool_server.fastpath.channel import Channel, memory_barrier
from kvpool_server.fastpath.records import _arrays
from kvpool_server.service.fair_share import key_of
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.prompt_hasher import HashJob

ORDER_S = 0.001  # the channels' order is recomputed at most this often


class Prepared(NamedTuple):
    """A register record copied out of its channel, its prompt hashed (by ``job``) or being hashed."""

    seq: int
    header: list[int]
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, bytes]
    job: HashJob

    @property
    def hashes(self) -> list[bytes] | None:
        return self.job.result


class FairChannels:
    def __init__(self, service: KVPoolService, wake: Callable[[], None]) -> None:
        self.service = service
        self.fair = service.fair
        self.hasher = service.hasher
        self.wake = wake  # wakes the fast-path thread (a parked one too): a job is done
        self.wake_lock = threading.Lock()  # a job's end (the hasher's thread) against close() (the server's stop)
        self.closed = False
        self.prepared: dict[Channel, Prepared] = {}
        self._order: list[Channel] = []
        self._order_at = 0.0

    def key(self, channel: Channel) -> int:
        return key_of(channel.session_id, channel.tenant, self.service.guard.sessions)

    def order(self, channels: list[Channel]) -> list[Channel]:
        """``channels`` (the live ones), the least-used sessions' first."""
        if len(channels) < 2:
            return channels
        now = time.monotonic()
        if now - self._order_at >= ORDER_S or len(self._order) != len(channels):
            usage = self.fair.usage
            self._order = sorted(channels, key=lambda c: usage(c.session_id))
            self._order_at = now
        return self._order

    def charge(self, channel: Channel, seconds: float) -> None:
        self.fair.charge(self.key(channel), seconds)

    def defer(self, channel: Channel, views: fp.Views, seq: int) -> bool:
        """True: not now -- the record's prompt is being hashed (the thread serves the other channels)."""
        prepared = self.prepared.get(channel)
        if prepared is not None:
            if prepared.seq == seq:
                return not prepared.job.done
            self.forget(channel)
        if int(views.req[fp.REQ_OP]) != fp.OP_REGISTER or not self.hasher.is_long(int(views.req[fp.REQ_N_TOKENS])):
            return False
        memory_barrier()  # the record's loads after the seq's
        header = views.req.tolist()  # what serve_record reads then, instead of the segment
        if header[fp.REQ_SEQ] != seq or header[fp.REQ_GENERATION] != channel.generation or header[fp.REQ_ARG1] < 0:
            return False  # serve_record refuses it
        try:
            arrays = _arrays(views, header)
            job = self.hasher.submit(self.key(channel), channel.tenant, arrays[2], header[fp.REQ_ARG1], arrays[3],
                                     self._hashed)
        except KVPoolError:  # a record too big for the area (refused by serve_record); the hasher full (inline)
            return False
        if job is None:  # a prompt register refuses: serve_record does, with its status
            return False
        ids, counts, _, extra = arrays
        self.prepared[channel] = Prepared(seq, header, (ids, counts, job.prompt, extra), job)
        return not job.done

    def take(self, channel: Channel) -> Prepared | None:
        """The record ``defer`` prepared, once (the thread serves it now)."""
        return self.prepared.pop(channel, None) if self.prepared else None

    def _hashed(self, job: HashJob) -> None:
        """On the hasher's thread: wake the fast-path thread -- never once ``close`` has run (its wake pipe's fd
        is closed then, and may be another file's)."""
        with self.wake_lock:
            if not self.closed:
                self.wake()

    def close(self) -> None:
        """The fast path stops: no more wakes; every job cancelled."""
        with self.wake_lock:
            self.closed = True
        for channel in list(self.prepared):
            self.forget(channel)

    def forget(self, channel: Channel) -> None:
        """The channel closed (or moved on): its job is cancelled, its copy dropped."""
        prepared = self.prepared.pop(channel, None)
        if prepared is not None:
            self.hasher.cancel(prepared.job)

    def check_invariants(self, live: list[Channel]) -> None:
        """At most one ``Prepared`` per channel, only for live channels, each for the record after the last one
        the channel served (``live``: the server's channels)."""
        channels = {id(c) for c in live}
        for channel, prepared in list(self.prepared.items()):
            assert id(channel) in channels, "fair channels: a prepared record of a closed channel"
            assert prepared.seq == channel.last_seq + 1, f"fair channels: record {prepared.seq} after {channel.last_seq}"
