"""The tokens file's schema (issues 20 and 24): a bad file is refused whole, at start (the process exits non-zero
naming the file, the key and the problem) and on SIGHUP (the server stays up with the old tokens and limits, and
logs why)."""

# ruff: noqa: B023  (each lambda is called within the iteration that made it)
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.service.auth import Authenticator, TokensFileError, hash_token
from kvpool_server.core.tenants import TenantLedger
from kvpool_server.service.tokens_file import load_tokens_file
from tests.conftest import SMALL_POOL_ARGS, server_command
from tests.security.tenant_helpers import TOKENS, As, code_of, write_tokens

NUM_BLOCKS = 256  # SMALL_POOL_ARGS' pool
QUOTA_A = "[tenants.a]\nmax_sessions = 1\n"  # the good file's: kept through every bad reload
DIGEST = hash_token("tok-x")


def token(tenant: str = '"a"', sha256: str = f'"{DIGEST}"', role: str = '"frontend"') -> str:
    return f"[[tokens]]\nsha256 = {sha256}\ntenant = {tenant}\nrole = {role}\n"


# (case id, what follows the good tokens (or, with a leading "!", the whole file), the problem the message names)
BAD_FILES = [
    ("not-utf8", "!# caf\xe9\n", "not UTF-8 (byte 0xe9 at offset 5)"),
    ("not-toml", "not [ toml", "not valid TOML"),
    ("tenants-not-a-table", "!tenants = 5\n", "tenants: must be a table of [tenants.<name>] sections, got int 5"),
    ("tenant-not-a-table", "!tenants.a = 3\n", "tenants.a: must be a table ([tenants.a] with its keys), got int 3"),
    ("tokens-not-an-array", "!tokens = \"x\"\n", "tokens: must be an array of [[tokens]] tables, got str 'x'"),
    ("token-not-a-table", "!tokens = [5]\n", "tokens[0]: must be a [[tokens]] table, got int 5"),
    ("max-blocks-abc%", '[tenants.c]\nmax_blocks = "abc%"\n', "tenants.c.max_blocks: a share of the pool is \"N%\""),
    ("max-blocks-0%", '[tenants.c]\nmax_blocks = "0%"\n', "tenants.c.max_blocks: a share"),
    ("max-blocks-150%", '[tenants.c]\nmax_blocks = "150%"\n', "with 0 < N <= 100, got '150%'"),
    ("max-blocks-negative", "[tenants.c]\nmax_blocks = -1\n", "tenants.c.max_blocks: must be a number of blocks"),
    ("max-sequences-many", '[tenants.c]\nmax_sequences = "many"\n',
     "tenants.c.max_sequences: must be a whole number >= 0, got str 'many'"),
    ("max-sessions-float", "[tenants.c]\nmax_sessions = 1.5\n", "tenants.c.max_sessions: must be a whole number"),
    ("may-attach-string", '[tenants.c]\nmay_attach = "false"\n', "tenants.c.may_attach: must be true or false"),
    ("reserved-over-max", "[tenants.c]\nmax_blocks = 4\nreserved_blocks = 5\n",
     "tenants.c.reserved_blocks: 5 is more than its max_blocks (4)"),
    ("reserved-over-pool", '[tenants.c]\nreserved_blocks = "60%"\n[tenants.d]\nreserved_blocks = "50%"\n',
     "the reserved_blocks sum to 281, more than the pool's 256 blocks"),
    ("bad-tenant-name", '[tenants."a b"]\n', "tenants.a b: a tenant name is"),
    ("sha256-int", token(sha256="5"), "tokens[3].sha256: must be 64 hex digits (kvpool-token hash TOKEN), got int 5"),
    ("sha256-short", token(sha256='"tok-secret"'), "tokens[3].sha256: must be 64 hex digits (kvpool-token hash "
                                                   "TOKEN), got 10 characters"),
    ("sha256-duplicate", token(sha256=f'"{hash_token("tok-a")}"'), "tokens[3].sha256: the same digest as tokens[0]"),
    ("role-root", token(role='"root"'), "tokens[3].role: must be one of frontend, admin, got str 'root'"),
    ("tenant-missing", "[[tokens]]\nsha256 = \"" + DIGEST + "\"\n", "tokens[3].tenant: must name a tenant, got nothing"),
    ("undefined-tenant", token(tenant='"zz"'), "tokens[3].tenant: tenant 'zz' is not defined (add a [tenants.zz] "
                                               "section; defined: a, b, ops)"),
    ("unknown-tenant-key", "[tenants.c]\nmax_block = 3\n", "tenants.c: unknown key 'max_block' (did you mean "
                                                           "'max_blocks'?)"),
    ("unknown-token-key", token() + 'comment = "x"\n', "tokens[3]: unknown key 'comment'"),
    ("misspelt-table", "[tenant.x]\nmax_blocks = 3\n", "the top level: unknown key 'tenant' (did you mean "
                                                       "'tenants'?)"),
]


def bad_file(path: Path, text: str) -> Path:
    """The good file (tokens a, b, ops; tenant a's quota) with ``text`` added, or ``text`` alone after a "!"."""
    if text.startswith("!"):
        path.write_bytes(text[1:].encode("latin-1"))
    else:
        write_tokens(path, tenants=QUOTA_A)
        path.write_bytes(path.read_bytes() + b"\n" + text.encode("latin-1"))
    return path


@pytest.mark.parametrize("text, problem", [case[1:] for case in BAD_FILES], ids=[case[0] for case in BAD_FILES])
def test_the_schema_names_each_problem(tmp_path, text, problem):
    path = bad_file(tmp_path / "tokens.toml", text)
    with pytest.raises(TokensFileError) as err:
        load_tokens_file(str(path), NUM_BLOCKS)
    assert str(err.value).startswith(f"{path}: ")
    assert problem in str(err.value)


def test_a_good_file_loads_with_its_defaults(tmp_path):
    b_tenant, upper_digest = '"b"', f'"{DIGEST.upper()}"'
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tenants.a]\nmax_blocks = "12.5%"\nreserved_blocks = 8\nmay_attach = true\n[tenants.b]\n'
                    f'{token(tenant=b_tenant, sha256=upper_digest)}'
                    f'[[tokens]]\nsha256 = "{hash_token("y")}"\ntenant = "a"\n')
    parsed = load_tokens_file(str(path), NUM_BLOCKS)
    assert parsed.tokens == {DIGEST: ("b", "frontend"), hash_token("y"): ("a", "frontend")}
    a, b = parsed.tenants["a"], parsed.tenants["b"]
    assert (a.limits.max_blocks, a.limits.reserved_blocks, a.limits.max_sequences, a.may_attach) == (32, 8, None, True)
    assert (b.limits.max_blocks, b.limits.reserved_blocks, b.may_attach, b.share_prefixes) == (None, 0, False, False)


def test_reload_of_a_bad_file_keeps_the_tokens_and_limits_and_never_raises(tmp_path, caplog):
    path = write_tokens(tmp_path / "tokens.toml", tenants=QUOTA_A)
    ledger = TenantLedger(8)
    auth = Authenticator(str(path), ledger, NUM_BLOCKS)
    assert auth.summary() == "auth on: 3 tokens (1 admin), 3 tenants"
    identities, limits = dict(auth.identities), list(ledger.limits)
    for name, text, problem in BAD_FILES:
        bad_file(path, text)
        with caplog.at_level(logging.ERROR, logger="kvpool_server.service.auth"):
            caplog.clear()
            assert auth.reload() is False, name
        assert problem in caplog.text, name
        assert auth.identities == identities and ledger.limits == limits, name
    path.unlink()
    assert auth.reload() is False and "cannot read tokens file" in caplog.text
    write_tokens(path, {"b": TOKENS["b"]})  # a good file again: applied; tenant a dropped keeps its quota
    assert auth.reload() is True
    assert auth.summary() == "auth on: 1 token (0 admin), 1 tenant"
    assert ledger.limits[ledger.tenant_id("a")].max_sessions == 1


@pytest.mark.parametrize("text, problem", [case[1:] for case in BAD_FILES], ids=[case[0] for case in BAD_FILES])
def test_a_bad_file_refuses_the_start(tmp_path, text, problem):
    path = bad_file(tmp_path / "tokens.toml", text)
    try:
        run = subprocess.run(server_command() + [*SMALL_POOL_ARGS, "--address", "127.0.0.1:0", "--auth-tokens",
                                                 str(path)], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired as exc:  # (killed by run)
        pytest.fail(f"the server started with the bad file:\n{exc.stderr}")
    assert run.returncode != 0
    assert f"kvpool-server: {path}: " in run.stderr and problem in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def test_sighup_with_a_bad_file_keeps_the_server_and_the_old_tokens(server_factory, tmp_path):
    path = write_tokens(tmp_path / "tokens.toml", tenants=QUOTA_A)
    server = server_factory("--auth-tokens", str(path))
    with grpc.insecure_channel(server.address) as channel:
        a, admin = As(channel, "tok-a"), As(channel, "tok-admin")
        for num_rejected, (name, text, problem) in enumerate(BAD_FILES, start=1):
            bad_file(path, text)
            os.kill(server.pid, signal.SIGHUP)
            deadline = time.monotonic() + 10
            while server.log().count("tokens file rejected") < num_rejected:
                assert server.proc.poll() is None, f"{name}: the server exited:\n{server.log()}"
                assert time.monotonic() < deadline, f"{name}: no log line after SIGHUP:\n{server.log()}"
                time.sleep(0.05)
            assert problem in server.log().split("tokens file rejected")[-1], name
            assert code_of(lambda: a.RegisterSequence(pb.RegisterSequenceRequest())) == grpc.StatusCode.OK, name
            assert code_of(lambda: admin.Stats(pb.StatsRequest())) == grpc.StatusCode.OK, name
        # tenant a's quota (max_sessions = 1) still holds, and the old tokens only
        code_of(lambda: a.OpenSession(pb.OpenSessionRequest()))
        assert code_of(lambda: a.OpenSession(pb.OpenSessionRequest())) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert code_of(lambda: As(channel, "tok-x").Stats(pb.StatsRequest())) == grpc.StatusCode.UNAUTHENTICATED
        write_tokens(path, {"b": TOKENS["b"]})  # a good file is applied again
        os.kill(server.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while code_of(lambda: a.Stats(pb.StatsRequest())) != grpc.StatusCode.UNAUTHENTICATED:
            assert time.monotonic() < deadline, "token a still accepted after a good file's SIGHUP"
            time.sleep(0.05)
    assert "SIGHUP: reloaded" in server.log() and "auth on: 1 token (0 admin), 1 tenant" in server.log()
    assert server.stop() == 0


def test_the_start_line_says_whether_auth_and_tls_are_on(server_factory, tmp_path):
    """Issue 24.3: how many tokens and tenants, and TLS, on the start line (not silently whatever the file said)."""
    from tests.security.tenant_helpers import write_tokens

    def start_line(server) -> str:  # written just after the server says SERVING: wait for it
        deadline = time.monotonic() + 30
        while "listening on" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.02)
        return server.log()

    secured = server_factory("--auth-tokens", str(write_tokens(tmp_path / "t.toml")))
    assert "auth on: 3 tokens (1 admin), 3 tenants; TLS off" in start_line(secured)
    assert "auth off; TLS off" in start_line(server_factory())
