"""StatsSampler: a thread that polls Stats every few milliseconds, the server's own view of memory over time.

The workers' records say what each process holds; the sampler sees the whole pool (internal fragmentation, shared
blocks, copies, live sequences) as the server counts it. A sample is one Stats RPC (about half a millisecond here),
so the default 5 ms period costs the server a few percent of one core.
"""

from __future__ import annotations

import threading
import time

from kvpool_client.client import KVPoolClient
from kvpool_client.errors import KVPoolClientError

FIELDS = ("t", "used", "free", "tokens", "unused", "shared", "copies", "seqs")


class StatsSampler:
    def __init__(self, target: str, interval_s: float = 0.005, timeout: float = 5.0) -> None:
        self.interval_s = interval_s
        self._client = KVPoolClient(target, timeout=timeout)
        self.series: dict[str, list[float]] = {name: [] for name in FIELDS}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-stats-sampler", daemon=True)

    def sample(self) -> None:
        try:
            stats = self._client.stats()
        except KVPoolClientError:
            self.errors += 1
            return
        s = self.series
        s["t"].append(time.monotonic())
        s["used"].append(stats.num_blocks_used)
        s["free"].append(stats.num_blocks_free)
        s["tokens"].append(stats.num_tokens)
        s["unused"].append(stats.num_slots_unused)
        s["shared"].append(stats.num_blocks_shared)
        s["copies"].append(stats.num_copies)
        s["seqs"].append(stats.num_sequences)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.sample()
            next_at += self.interval_s
            delay = next_at - time.monotonic()
            if delay < 0:
                next_at = time.monotonic()
            else:
                self._stop.wait(delay)

    def start(self) -> StatsSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # one last look, after the workers are done
        self._client.close()
