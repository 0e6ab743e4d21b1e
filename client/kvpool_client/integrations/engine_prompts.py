"""What the decode engine needs for prefix caching (docs/prefix-caching.md, "The engines"): prompts registered with
their token ids, the cached run the server reports taken into the engine's tables, and a fence so that no block
the engine filled is sealed before its KV is written.

    register_prompts([prompt], [key]) -> run         the server's longest cached run (the host tier's part restored
                                                     before it replies); cached <= len(prompt) - 1, whole blocks,
                                                     and its block ids (the fast path's reply carries them: one
                                                     round trip), checked, into ``SeqTables`` row of seq
    prefill(prompt[cached:])                         only the suffix computed; its attention reads the run's KV

A block the engine fills is sealed by the server at that sequence's next append, which says "its KV is written".
On CUDA a prefill's writes are enqueued, not done, when ``prefill`` returns: ``WriteFence`` records an event per
device after them and every append waits for it first, so a block is never matchable -- never another frontend's
hit -- before its KV is in the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvpool_client.integrations.seq_tables import SeqTables


def register_prompt(control: Any, tables: SeqTables, prompt: Sequence[int], cache_key: bytes,
                    num_blocks: int) -> tuple[int, int]:
    """A sequence registered with ``prompt``'s token ids, its cached run in ``tables``; (seq, cached tokens). A
    reply that breaks the protocol (a run longer than the prompt allows, blocks outside the pool, a table that
    disagrees with the count) raises ValueError and leaves no sequence behind."""
    if not len(prompt):
        raise ValueError("a prompt needs at least one token (its last token's logits are the output)")
    run = control.register_prompts([list(prompt)], cache_extra_keys=[cache_key])
    if len(run) != 1:
        raise ValueError(f"the server answered {len(run)} sequences for one prompt")
    seq, cached = run[0].seq_id, run[0].num_cached_tokens
    try:
        bs = tables.block_size
        if not 0 <= cached <= len(prompt) - 1 or cached % bs:
            raise ValueError(f"the server reported {cached} cached tokens for a prompt of {len(prompt)} "
                             f"(whole blocks of {bs}, at most len - 1)")
        block_ids = np.asarray(run[0].cached_block_ids, dtype=np.int64)
        if block_ids.size != cached // bs or (block_ids.size and (block_ids.min() < 0 or block_ids.max() >= num_blocks)):
            raise ValueError(f"the cached run of sequence {seq} ({cached} tokens) has the blocks "
                             f"{block_ids.tolist()} in a pool of {num_blocks}")
        tables.start(seq, block_ids, cached)
    except BaseException:
        control.free([seq])
        raise
    return seq, cached


class WriteFence:
    """The device work that wrote blocks the server may seal: waited for before the next append. On the CPU the
    forward is synchronous and there is nothing to wait for."""

    def __init__(self) -> None:
        self._events: list[Any] = []

    def record(self, devices: Sequence[torch.device]) -> None:
        """After a forward that wrote KV: one event per CUDA device, on its current stream."""
        events = []
        for device in devices:
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                events.append(event)
        self._events = events

    def wait(self) -> None:
        """Before an append: the recorded writes have run (free once they have: an event that completed)."""
        for event in self._events:
            event.synchronize()
        self._events = []

    @property
    def pending(self) -> bool:
        return bool(self._events)
