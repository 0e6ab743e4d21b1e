"""Before every Free: does the sequence's KV, found through its page table (and ReadKV), hold what its writers
wrote? Counts every differing token, per check; keeps the first messages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool_client.attach import AttachedPool
from kvpool_client.rank_group import RankGroup
from kvpool_client.client import KVPoolClient
from kvpool_client.loadgen.pattern import history_keys, kv_pattern, token_keys
from kvpool_client.loadgen.sequences import Seq

MAX_MESSAGES = 10


class Verifier:
    """``method``: "table" (GetBlockTable + the attached pool), "readkv" (ReadKV) or "both". ``timed(name, fn,
    *args)`` runs an RPC and records its latency; ``counts`` is the worker's counter dict."""

    def __init__(self, client: KVPoolClient, pool: AttachedPool | RankGroup | None, method: str, timed: Callable[..., Any],
                 counts: dict[str, int]) -> None:
        """``pool`` None: the pool is not mapped (KV over gRPC), so every check is by ReadKV."""
        self.client = client
        self.pool = pool
        self.layout = client.layout
        self.method = method if pool is not None else "readkv"
        self.timed = timed
        self.counts = counts
        self.errors: list[str] = []

    def corrupt(self, s: Seq) -> None:
        """Self-test (--inject-errors): overwrite the sequence's last token with another token's KV."""
        wrong = kv_pattern(token_keys(s.seq_id, s.length, s.length + 1), self.layout)
        if self.pool is None:
            self.client.write_kv(s.seq_id, s.length - 1, wrong)
        else:
            self.pool.write_slots([s.last_slot], wrong)
        self.counts["errors_injected"] += 1

    def verify(self, s: Seq) -> None:
        """Compare the sequence's KV, found through its page table, with what its writers wrote."""
        expected = kv_pattern(history_keys(s.history), self.layout)
        self.counts["tokens_verified"] += s.length
        if self.method in ("table", "both"):
            table = self.timed("block_table", self.client.block_table, s.seq_id)
            if table.num_tokens != s.length:
                self._error(s, f"page table has {table.num_tokens} tokens, expected {s.length}", s.length)
            else:
                self._compare(s, "attached pool", self.pool.read_slots(table.slots()), expected)  # type: ignore[union-attr]
        if self.method in ("readkv", "both"):
            self._compare(s, "ReadKV", self.timed("read_kv", self.client.read_kv, s.seq_id), expected)

    def _compare(self, s: Seq, via: str, got: np.ndarray, expected: np.ndarray) -> None:
        if got.shape != expected.shape:
            self._error(s, f"{via}: shape {got.shape}, expected {expected.shape}", s.length)
            return
        bad = np.flatnonzero((got.reshape(len(got), -1) != expected.reshape(len(expected), -1)).any(axis=1))
        if bad.size:
            self._error(s, f"{via}: {bad.size} tokens differ, first at position {int(bad[0])}", int(bad.size))

    def _error(self, s: Seq, message: str, num_tokens: int) -> None:
        self.counts["verify_errors"] += num_tokens
        self.counts["checks_failed"] += 1
        if len(self.errors) < MAX_MESSAGES:
            self.errors.append(f"seq {s.seq_id} (len {s.length}): {message}")
