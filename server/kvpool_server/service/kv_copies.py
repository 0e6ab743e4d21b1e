"""WriteKV / ReadKV copies too big for the event loop: done on a copy thread, in chunks, with their sequence pinned.

A big copy (a 64 MiB WriteKV is ~130,000 tokens of the seed layout) would stall every other call if it ran on the
event loop, and hold the pool for tens of ms if it ran in one piece. So the servicer resolves the slots under its
lock (on the loop, quick), pins the sequence, and returns an ``Offload`` whose work copies ``CHUNK_BYTES`` at a
time (each chunk one ``pool.write_slots`` / ``read_slots``, which hold the pool's own lock only for that chunk).

Pinning keeps the resolved slots meaning what they meant: a copy's sequence is pinned in the same lock hold that
resolved its slots, and ``Free`` and ``Fork`` look for pins in the hold that would apply them (any transport's
thread: the fast path's too), so while a sequence is pinned they wait (``Wait``) until its copies are done -- a Free would let its blocks go to another sequence mid-copy, a Fork
would share blocks whose bytes are still being written. Appends to it may go on: they never touch the blocks a
copy was given (a written block is the sequence's alone, so an append writes after it, never copies it).

Invariant: ``_pins[s]`` is the number of copies in flight on sequence ``s`` (absent when none).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import numpy as np

from kvpool_server.service.answers import Wait
from kvpool_server.device.protocol import Pool

CHUNK_BYTES = 1 << 20  # one pool operation at most this big: a few hundred microseconds
INLINE_BYTES = 256 << 10  # copies up to this size run on the loop under the lock (cheaper than a thread hop)


class SequencePins:
    def __init__(self) -> None:
        self._pins: dict[int, int] = {}
        self._unpinned: asyncio.Future | None = None

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, seq_id: int) -> None:
        self._pins[seq_id] = self._pins.get(seq_id, 0) + 1

    def unpin(self, seq_id: int) -> None:
        left = self._pins[seq_id] - 1
        if left:
            self._pins[seq_id] = left
            return
        del self._pins[seq_id]
        if self._unpinned is not None and not self._unpinned.done():
            self._unpinned.set_result(None)  # waiters re-check; others may still be pinned
        self._unpinned = None

    def wait_unpinned(self, seq_ids: Iterable[int]) -> None:
        """Raise ``Wait`` while any of ``seq_ids`` has a copy in flight. Callable on any thread (the fast path's
        too): the Wait's awaitable is a coroutine that needs the event loop only when it is awaited there."""
        keys = [int(s) for s in seq_ids]
        if self._pins and any(key in self._pins for key in keys):
            raise Wait(self._until_unpinned(keys))

    async def _until_unpinned(self, keys: list[int]) -> None:
        """On the loop, where pins are taken and dropped: return once none of ``keys`` is pinned."""
        while self._pins and any(key in self._pins for key in keys):
            if self._unpinned is None:
                self._unpinned = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._unpinned)


def chunk_tokens(token_bytes: int) -> int:
    return max(1, CHUNK_BYTES // token_bytes)


def write_chunked(pool: Pool, slots: np.ndarray, tokens: np.ndarray, chunk: int) -> None:
    for start in range(0, len(slots), chunk):
        pool.write_slots(slots[start:start + chunk], tokens[start:start + chunk])


def read_chunked(pool: Pool, slots: np.ndarray, out: np.ndarray, chunk: int) -> np.ndarray:
    for start in range(0, len(slots), chunk):
        out[start:start + chunk] = pool.read_slots(slots[start:start + chunk])
    return out
