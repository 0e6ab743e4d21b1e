"""Per-tenant usage says a quota as the tokens file meant it (issue 35 item 6): no limit is None (unset on the wire),
0 is "none allowed" -- kvctl stats --json shows null and 0, never 0 for both."""

from __future__ import annotations

import json

from kvpool_client import KVPoolClient
from kvpool_client.kvctl import main as kvctl_main
from tests.security.tenant_helpers import write_tokens


def test_no_limit_and_none_allowed_are_told_apart(server_factory, tmp_path, capsys):
    tokens = write_tokens(tmp_path / "tokens.toml", tenants="[tenants.a]\nmax_sessions = 0\nmax_blocks = 8\n")
    server = server_factory("--auth-tokens", str(tokens), "--insecure")
    with KVPoolClient(server.address, token="tok-admin", session=False) as kv:
        usage = {u.tenant: u for u in kv.stats().tenants}
    assert (usage["a"].max_sessions, usage["a"].max_blocks, usage["a"].max_sequences) == (0, 8, None)
    assert (usage["b"].max_sessions, usage["b"].max_blocks) == (None, None)
    (tmp_path / "admin-token").write_text("tok-admin\n")
    assert kvctl_main(["--target", server.address, "--token-file", str(tmp_path / "admin-token"), "stats",
                       "--json"]) == 0
    tenants = {t["tenant"]: t for t in json.loads(capsys.readouterr().out)["tenants"]}
    assert tenants["a"]["max_sessions"] == 0 and tenants["b"]["max_sessions"] is None
