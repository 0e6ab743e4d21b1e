"""A batch published off the event loop's thread -- the fast path's serving thread publishes the events of the
records it applies -- wakes the subscribers waiting on the loop (an asyncio.Event set from another thread would
not: the loop would sleep on until something else woke it, a subscriber's next poll)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from kvpool_server.core import KVCacheManager
from kvpool_server.service.events import EventFeed


def test_a_batch_published_from_another_thread_wakes_a_waiting_subscriber() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=4)
    feed = EventFeed(1, manager.allocator.cache)
    seq = manager.register()
    manager.append(seq, 5, token_ids=np.arange(5, dtype=np.uint32))  # block 0 filled: sealed by the next append
    loop = asyncio.new_event_loop()
    waiting, woke = threading.Event(), threading.Event()

    async def subscriber() -> None:
        waiter = feed.waiter()
        waiting.set()
        await waiter.wait()  # no timeout: nothing but the publish wakes this loop
        woke.set()

    task = loop.create_task(subscriber())
    thread = threading.Thread(target=loop.run_until_complete, args=(task,))
    thread.start()
    try:
        assert waiting.wait(10)
        manager.append(seq, 1, token_ids=[9])  # seals block 0: a BlockStored pending
        feed.publish()  # from this thread, not the loop's
        assert woke.wait(5), "the subscriber was not woken"
        assert feed.log.next_seq == 2
    finally:
        if not woke.is_set():
            loop.call_soon_threadsafe(task.cancel)
        thread.join(10)
        loop.close()
