"""Fixtures shared by the host tier's service tests (test_service_host_tier.py, test_tier_restore_unlocked.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.scope import CallScope


@pytest.fixture
def tiered() -> Iterator[tuple[KVPoolService, CallScope]]:
    """A service with a 64-block host tier that offloads on eviction only (the tests drive the write-backs)."""
    from tests.offload.test_service_host_tier import make  # noqa: PLC0415  (the tests' own builder)

    svc, scope = make(64)
    try:
        yield svc, scope
    finally:
        svc.guard.pool.close()
