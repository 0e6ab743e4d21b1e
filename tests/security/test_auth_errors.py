"""What a frontend catches when the server refuses it: its own class for each refusal, and a message that says what
to do (issue 24.2). Real servers with --auth-tokens."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool_client import (
    AttachNotAllowedError,
    KVPoolClient,
    PermissionDeniedError,
    UnauthenticatedError,
)
from kvpool_client.errors import UnknownError
from tests.security.tenant_helpers import write_tokens


@pytest.fixture
def auth_server(server_factory, tmp_path):
    """Tenant a may not attach (the default); tenant b may; ops is an admin."""
    return server_factory("--auth-tokens", str(write_tokens(tmp_path / "t.toml",
                                                            tenants="[tenants.b]\nmay_attach = true\n")))


def test_no_token_and_an_unknown_token_raise_unauthenticated(auth_server):
    for token in (None, "not-a-token"):
        with KVPoolClient(auth_server.address, token=token, session=False) as client:
            with pytest.raises(UnauthenticatedError) as err:
                client.stats()
        assert not isinstance(err.value, UnknownError)
        assert err.value.method == "Stats"


def test_a_frontend_calling_an_admin_rpc_raises_permission_denied(auth_server):
    with KVPoolClient(auth_server.address, token="tok-a", session=False) as client:
        with pytest.raises(PermissionDeniedError) as err:
            client.check_invariants()
    assert not isinstance(err.value, (UnknownError, AttachNotAllowedError))


def test_attach_by_a_tenant_that_may_not_says_so_and_what_to_do(auth_server):
    with KVPoolClient(auth_server.address, token="tok-a") as client:
        with pytest.raises(AttachNotAllowedError) as err:
            client.attach()
        message = str(err.value)
        assert "may not attach" in message and "may_attach = true" in message and "write_kv" in message
        assert isinstance(err.value, PermissionDeniedError) and not isinstance(err.value, OSError)
        # what the message offers instead works
        seq = client.register()
        slots = client.append([seq], 3).slot_mapping
        kv = np.arange(3 * int(np.prod(client.layout.token_shape)), dtype=client.layout.storage_dtype)
        client.write_kv(seq, 0, kv.reshape(3, *client.layout.token_shape))
        assert (client.read_kv(seq) == kv.reshape(3, *client.layout.token_shape)).all() and slots.size == 3
    with KVPoolClient(auth_server.address, token="tok-b") as client, client.attach() as pool:
        assert pool.num_blocks == 256


def test_attach_where_the_pool_is_not_visible_says_so(server):
    """What attach() meets in another container or IPC namespace: the segment DescribePool names is not there."""
    import dataclasses

    from kvpool_client import PoolNotMappableError
    from kvpool_client.attach import attach

    with KVPoolClient(server.address) as client:
        description = dataclasses.replace(client.describe_pool(), shm_name="kvpool-1-0-0-elsewhere")
        with pytest.raises(PoolNotMappableError) as err:
            attach(description, client._session)
    message = str(err.value)
    assert "another host, or in another container or IPC namespace" in message and "write_kv" in message
    assert isinstance(err.value, OSError)
