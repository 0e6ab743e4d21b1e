"""The Pool protocol (device/protocol.py): what the service holds a pool as."""

from __future__ import annotations

from kvpool.layout import KVLayout
from kvpool_server.device import create_pool
from kvpool_server.device.protocol import Pool


def test_the_host_pool_is_a_pool() -> None:
    """``Pool`` is runtime-checkable: this checks the member names (the GPU pool shares KVPool's, see device/)."""
    with create_pool(KVLayout(), backend="host", num_blocks=4) as pool:
        assert isinstance(pool, Pool)
    assert not isinstance(object(), Pool)
