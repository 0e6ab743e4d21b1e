"""kvpool-loadgen --tenants: two tenants at once against a server with --auth-tokens, one of them under a quota."""

from __future__ import annotations

import pytest

from kvpool_client.loadgen.tenants import TokenFileError, read_token_file, worker_token
from tests.loadgen.test_loadgen_e2e import POOL, loadgen
from tests.security.tenant_helpers import write_tokens

QUOTA_A = 8
TENANTS = f"""
[tenants.a]
max_blocks = {QUOTA_A}
may_attach = true

[tenants.b]
may_attach = true
"""
RUN = ("--processes", "2", "--concurrency", "4", "--completions", "12", "--max-len", "80", "--seed", "5",
       "--exhausted-wait", "3")


def _server_and_token_file(server_factory, tmp_path):
    server = server_factory(*POOL, "--auth-tokens", str(write_tokens(tmp_path / "auth.toml", tenants=TENANTS)))
    token_file = tmp_path / "tokens.txt"
    token_file.write_text("# tenant token\na tok-a\nb tok-b\n")
    return server, token_file


def _check_tenants(summary: dict, output: str) -> None:
    tenants = summary["tenants"]
    assert set(tenants) == {"a", "b"}, output
    a, b = tenants["a"], tenants["b"]
    assert a["processes"] == b["processes"] == 1
    assert a["max_blocks"] == QUOTA_A and b["max_blocks"] is None  # no limit (0 would be none allowed)
    assert a["peak_blocks"] > 0 and b["peak_blocks"] > 0 and a["avg_blocks"] > 0 and b["avg_blocks"] > 0
    # the quota-limited tenant never holds more than its quota, in any sample; the other one proceeds
    assert a["peak_blocks"] <= QUOTA_A
    assert max(summary["series"]["tenants"]["a"]["blocks"]) <= QUOTA_A
    assert b["completions"] > 0 and b["sequences"] > 0
    assert "tenant" in output and "quota refusals" in output
    if summary["ok"]:
        assert a["completions"] > 0 and a["completions"] + b["completions"] == 12
        assert summary["end"]["blocks_used"] == 0
    else:  # a's two requests ran into its quota together: the run says so
        assert any("max_blocks" in e for e in summary["worker_errors"]), output
    assert "tok-a" not in str(summary["config"]) and "tok-b" not in str(summary["config"])


def test_two_tenants_one_under_a_quota(server_factory, tmp_path):
    server, token_file = _server_and_token_file(server_factory, tmp_path)
    rc, summary, output = loadgen(server.address, tmp_path, *RUN, "--tenants", "2", "--token-file", str(token_file))
    assert rc in (0, 1), output
    _check_tenants(summary, output)
    assert not summary["end"]["invariants_checked"]  # a frontend token may not call CheckInvariants
    assert "not checked" in output


def test_two_tenants_sampled_with_an_admin_token(server_factory, tmp_path):
    server, token_file = _server_and_token_file(server_factory, tmp_path)
    (tmp_path / "admin-token").write_text("tok-admin\n")
    rc, summary, output = loadgen(server.address, tmp_path, *RUN, "--tenants", "2", "--token-file", str(token_file),
                                  "--admin-token-file", str(tmp_path / "admin-token"))
    assert rc in (0, 1), output
    _check_tenants(summary, output)
    assert summary["end"]["invariants_checked"] and summary["end"]["invariants_ok"]


def test_without_a_token_the_server_refuses(server_factory, tmp_path):
    server, _ = _server_and_token_file(server_factory, tmp_path)
    rc, _, output = loadgen(server.address, tmp_path, *RUN)
    assert rc == 2 and "UNAUTHENTICATED" in output


def test_token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("a tok-a  # first\n\nb tok-b\nc tok-c\n")
    assert read_token_file(path, 2) == [("a", "tok-a"), ("b", "tok-b")]
    with pytest.raises(TokenFileError, match="needs 4"):
        read_token_file(path, 4)
    path.write_text("a tok-a extra\n")
    with pytest.raises(TokenFileError, match="expected 'TENANT TOKEN'"):
        read_token_file(path, 1)
    pairs = [("a", "x"), ("b", "y")]
    assert [worker_token(pairs, i, None)[0] for i in range(4)] == ["a", "b", "a", "b"]
    assert worker_token([], 3, "t") == ("", "t")
