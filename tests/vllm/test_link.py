"""The connector's start-up against a real kvpool server: a pool that cannot hold the model's KV is refused with
both layouts named, a tenant that may not map the pool is refused, an absent server is a warning and a retry."""

from __future__ import annotations

import hashlib
import logging

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` installs it (CPU) and runs these")

from kvpool_client.integrations.vllm.link import KVPoolLink  # noqa: E402
from kvpool_client.integrations.vllm.settings import (  # noqa: E402
    ConnectorConfigError,
    ConnectorSettings,
    LayoutMismatchError,
    ModelLayout,
)
from tests.conftest import start_server  # noqa: E402
from tests.vllm.tiny_model import server_layout_args  # noqa: E402

MODEL = ModelLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype="float32")


def test_a_pool_of_another_layout_is_refused_naming_both(tmp_path):
    server = start_server(tmp_path, "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "64",
                          "--block-size", "16", "--dtype", "float32", unix=True)
    try:
        with pytest.raises(LayoutMismatchError) as raised:
            KVPoolLink(ConnectorSettings(server.address), MODEL)
        message = str(raised.value)
        assert "2 layers, 2 KV heads, head size 32, block size 32, float32" in message
        assert "1 layers, 1 KV heads, head size 64, block size 16, float32" in message
        assert "--num-layers 2" in message
    finally:
        server.stop()


def test_a_tenant_that_may_not_map_the_pool_is_refused(tmp_path):
    token = "t-no-attach"
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tenants.gamma]\nmay_attach = false\n\n[[tokens]]\n'
                      f'sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\ntenant = "gamma"\n')
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    server = start_server(tmp_path, "--auth-tokens", str(tokens), "--num-blocks", "64", *server_layout_args(),
                          unix=True)
    try:
        with pytest.raises(ConnectorConfigError, match="may_attach"):
            KVPoolLink(ConnectorSettings(server.address, token_file=str(token_file)), MODEL)
    finally:
        server.stop()


def test_an_absent_server_is_one_warning_and_no_client(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kvpool_client.integrations.vllm")
    link = KVPoolLink(ConnectorSettings(f"unix:{tmp_path}/none.sock", retry_s=60.0), MODEL)
    try:
        assert link.client is None
        warnings = [r for r in caplog.records if "is not reachable" in r.getMessage()]
        assert len(warnings) == 1
        assert link.call("RegisterSequence", lambda c: c.register()) is None  # a miss, no error
    finally:
        link.close()
