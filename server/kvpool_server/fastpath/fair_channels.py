"""FairChannels: the fast-path thread's fair share across sessions (``service.fair``, docs/fast-path.md).

    a record     its serving time is added to its channel's raw seconds (``charge``: no lock, no exp -- the
                 thread's cost per record is a dict update)
    every ORDER_S the raw seconds are folded into the sessions' decayed usage (``FairShare.charge_many``: one
                 lock), and the order is decided again: while no session is over its share (the usual case),
                 each pass serves the channels as they are, round-robin, and costs nothing; while some are,
                 their channels come after the others', the most-used last (re-sorted every ORDER_S)
    a register   of a prompt over CHUNK_BLOCKS blocks: copied out of the segment (header, arrays) and its hashes
                 queued on the hasher (``prompt_hasher``); the channel is skipped -- the thread serves the others
                 -- until the hashes are there (the hasher wakes the thread), then the record is served from that
                 copy with those hashes (``serve_record(prepared=...)``): the client cannot change it meanwhile
    a register   of several prompts (``register_many``) of more than CHUNK_BLOCKS blocks in all: the same, one job
    many         a prompt (``register_many.submit``); served once the last is done
    a step       whose tokens (its append's and its prompts') pass CHUNK_BLOCKS blocks: its register part's prompts
                 the same (``step.register_arrays``)

Never a wait on the thread. Bounded: at most one ``Prepared`` and one raw-seconds entry per live channel (``forget``
when it closes: its seconds are folded then).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kvpool import fastpath as fp
from kvpool_server.core.errors import KVPoolError
from kvpool_server.fastpath import register_many, step
from kvpool_server.fastpath.channel import Channel, memory_barrier
from kvpool_server.fastpath.records import _arrays
from kvpool_server.service.fair_share import key_of
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.prompt_hasher import HashJob

ORDER_S = 0.001  # the raw seconds are folded, and the channels' order decided, at most this often


class Prepared(NamedTuple):
    """A register (or register-many) record copied out of its channel, its prompts hashed (by ``jobs``, one a
    prompt, in order) or being hashed."""

    seq: int
    header: list[int]
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, bytes]
    jobs: tuple[HashJob, ...]

    @property
    def done(self) -> bool:
        return self.jobs[-1].done  # a session's jobs end in order (prompt_hasher)

    @property
    def hashes(self) -> list[list[bytes] | None]:
        return [job.result for job in self.jobs]


class FairChannels:
    def __init__(self, service: KVPoolService, wake: Callable[[], None]) -> None:
        self.service = service
        self.fair = service.fair
        self.hasher = service.hasher
        self.wake = wake  # wakes the fast-path thread (a parked one too): a job is done
        self.wake_lock = threading.Lock()  # a job's end (the hasher's thread) against close() (the server's stop)
        self.closed = False
        self.prepared: dict[Channel, Prepared] = {}
        self.spent: dict[Channel, float] = {}  # channel -> seconds served since the last fold (this thread's)
        self._over: dict[int, float] = {}  # key -> usage of the sessions over their share, as of the last fold
        self._order: list[Channel] | None = None  # the pass's order while some session is over; None: as given
        self._folded_at = 0.0

    def key(self, channel: Channel) -> int:
        return key_of(channel.session_id, channel.tenant, self.service.guard.sessions)

    def order(self, channels: list[Channel]) -> list[Channel]:
        """``channels`` (the live ones) in the order this pass serves them: as given while no session is over its
        share; else those sessions' channels after the others', the most-used last."""
        now = self.fair.clock()
        if now - self._folded_at >= ORDER_S:
            self._folded_at = now
            self.fold()
            self._over = self.fair.over_share()
            self._order = None
        if not self._over or len(channels) < 2:
            return channels
        if self._order is None or len(self._order) != len(channels):
            over, key = self._over, self.key
            self._order = sorted(channels, key=lambda c: over.get(key(c), 0.0))  # stable: the others as given
        return self._order

    def charge(self, channel: Channel, seconds: float) -> None:
        """A record's serving time, on the thread: added up per channel, folded by the first ``order`` ORDER_S or
        more after the last fold (or when the channel closes)."""
        spent = self.spent
        spent[channel] = spent.get(channel, 0.0) + seconds

    def fold(self) -> None:
        """The channels' raw seconds into their sessions' decayed usage, under the accountant's lock once."""
        if not self.spent:
            return
        spent, self.spent = self.spent, {}
        by_key: dict[int, float] = {}
        for channel, seconds in spent.items():
            key = self.key(channel)
            by_key[key] = by_key.get(key, 0.0) + seconds
        self.fair.charge_many(by_key)

    def defer(self, channel: Channel, views: fp.Views, seq: int) -> bool:
        """True: not now -- the record's prompt is being hashed (the thread serves the other channels)."""
        prepared = self.prepared.get(channel)
        if prepared is not None:
            if prepared.seq == seq:
                return not prepared.done
            self._drop(channel)
        words = views.req_words
        op, n_tokens = words[fp.REQ_OP], words[fp.REQ_N_TOKENS]
        if not (op == fp.OP_REGISTER and self.hasher.is_long(n_tokens) or
                op in (fp.OP_REGISTER_MANY, fp.OP_STEP) and self.hasher.is_long_batch(n_tokens)):
            return False
        memory_barrier()  # the record's loads after the seq's
        header = views.req.tolist()  # what serve_record reads then, instead of the segment
        if header[fp.REQ_SEQ] != seq or header[fp.REQ_GENERATION] != channel.generation or \
                op == fp.OP_REGISTER and header[fp.REQ_ARG1] < 0:
            return False  # serve_record refuses it (a register-many record has no arg1)
        try:
            arrays = _arrays(views, header)
            if op in (fp.OP_REGISTER_MANY, fp.OP_STEP):
                batch = arrays if op == fp.OP_REGISTER_MANY else step.register_arrays(arrays, header)
                many = None if batch is None else register_many.submit(self.service, self.key(channel),
                                                                       channel.tenant, batch, self._hashed)
                jobs = None if many is None else tuple(many)
            else:
                job = self.hasher.submit(self.key(channel), channel.tenant, arrays[2], header[fp.REQ_ARG1],
                                         arrays[3], self._hashed)
                jobs = None if job is None else (job,)
        except KVPoolError:  # a record too big for the area (refused by serve_record); the hasher full (inline)
            return False
        if jobs is None:  # a prompt register refuses: serve_record does, with its status
            return False
        ids, counts, tokens, extra = arrays
        if op == fp.OP_REGISTER:
            tokens = jobs[0].prompt  # the copy hashed (a register-many's jobs hashed copies of ``tokens``' slices)
        prepared = self.prepared[channel] = Prepared(seq, header, (ids, counts, tokens, extra), jobs)
        return not prepared.done

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
            self._drop(channel)
        self.fold()

    def forget(self, channel: Channel) -> None:
        """The channel closed: its seconds folded, its job cancelled, its copy dropped."""
        if channel in self.spent:
            self.fold()
        self._drop(channel)

    def _drop(self, channel: Channel) -> None:
        """The channel's prepared record, if any, is no longer wanted: its job cancelled, its copy dropped."""
        prepared = self.prepared.pop(channel, None)
        if prepared is not None:
            for job in prepared.jobs:
                self.hasher.cancel(job)

    def check_invariants(self, live: list[Channel]) -> None:
        """At most one ``Prepared`` per channel, only for live channels, each for the record after the last one
        the channel served (``live``: the server's channels); raw seconds only of live channels, >= 0."""
        channels = {id(c) for c in live}
        for channel, seconds in list(self.spent.items()):
            assert id(channel) in channels, "fair channels: raw seconds of a closed channel"
            assert seconds >= 0, f"fair channels: {seconds} s spent"
        for channel, prepared in list(self.prepared.items()):
            assert id(channel) in channels, "fair channels: a prepared record of a closed channel"
            assert prepared.seq == channel.last_seq + 1, f"fair channels: record {prepared.seq} after {channel.last_seq}"
