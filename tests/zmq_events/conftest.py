"""Fixtures of tests/zmq_events: ``ipc_dir``, a short directory for ipc:// endpoints (at most 107 bytes)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvz-", dir="/tmp")  # an ipc:// path is at most 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)
