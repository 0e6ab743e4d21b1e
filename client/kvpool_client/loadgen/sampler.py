"""StatsSampler: a thread that polls Stats every few milliseconds, the server's own view of memory over time.

The workers' records say what each process holds; the sampler sees the whole pool (internal fragmentation, shared
blocks, copies, live sequences) as the server counts it. A sample is one Stats RPC (about half a millisecond here),
so the default 5 ms period costs the server a few percent of one core.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvpool_client.client import KVPoolClient
from kvpool_client.credentials import Credentials
from kvpool_client.errors import KVPoolClientError
from kvpool_client.types import PoolStats

FIELDS = ("t", "used", "free", "tokens", "unused", "shared", "copies", "seqs", "evictable")
TENANT_FIELDS = ("t", "blocks", "seqs")


class StatsSampler:
    """``tokens``: one Stats call per token each sample (the pool's totals from the first); ``tenants``: the tenants
    whose usage (the Stats response's TenantUsage) goes into ``tenant_series`` -- one token per tenant, or one admin
    token that sees them all."""

    def __init__(
        self,
        target: str,
        interval_s: float = 0.005,
        timeout: float = 5.0,
        *,
        tokens: Sequence[str | None] = (None,),
        tenants: Sequence[str] = (),
        credentials: Credentials | None = None,
    ) -> None:
        self.interval_s = interval_s
        creds = credentials or Credentials()
        self._clients = [KVPoolClient(target, timeout=timeout, **creds.with_token(token).client_kwargs())
                         for token in tokens]
        self.series: dict[str, list[float]] = {name: [] for name in FIELDS}
        self.tenant_series: dict[str, dict[str, list[float]]] = {
            name: {field: [] for field in TENANT_FIELDS} for name in tenants
        }
        self.quotas: dict[str, int | None] = {}  # tenant -> max_blocks (None: no limit), as Stats last reported it
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-stats-sampler", daemon=True)

    def sample(self) -> None:
        for i, client in enumerate(self._clients):
            try:
                stats = client.stats()
            except KVPoolClientError:
                self.errors += 1
                continue
            now = time.monotonic()
            for usage in stats.tenants:
                series = self.tenant_series.get(usage.tenant)
                if series is not None:
                    series["t"].append(now)
                    series["blocks"].append(usage.num_blocks)
                    series["seqs"].append(usage.num_sequences)
                    self.quotas[usage.tenant] = usage.max_blocks
            if i == 0:
                self._record(stats)

    def _record(self, stats: PoolStats) -> None:
        s = self.series
        s["t"].append(time.monotonic())
        s["used"].append(stats.num_blocks_used)
        s["free"].append(stats.num_blocks_free)
        s["tokens"].append(stats.num_tokens)
        s["unused"].append(stats.num_slots_unused)
        s["shared"].append(stats.num_blocks_shared)
        s["copies"].append(stats.num_copies)
        s["seqs"].append(stats.num_sequences)
        s["evictable"].append(stats.num_blocks_evictable)

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
        for client in self._clients:
            client.close()
