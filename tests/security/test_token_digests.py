"""``Authenticator.identify`` keeps a known token's digest (a fast-path channel's every record carries the same
header): the digest is still looked up in the current tokens at every call, so a token revoked by a reload is
refused at its next call; unknown tokens are never kept, and the kept ones are bounded."""

from __future__ import annotations

import pytest

from kvpool_server.core.tenants import TenantLedger
from kvpool_server.service import auth as auth_module
from kvpool_server.service.auth import Authenticator
from kvpool_server.service.errors import PermissionDeniedError, UnauthenticatedError
from tests.security.tenant_helpers import TOKENS, write_tokens


def test_a_kept_digest_is_refused_once_its_token_is_revoked(tmp_path) -> None:
    path = write_tokens(tmp_path / "tokens.toml")
    auth = Authenticator(str(path), TenantLedger(8), 256)
    for _ in range(2):  # computed, then kept
        assert auth.identify("Bearer tok-a", "AppendToken").tenant == "a"
    with pytest.raises(PermissionDeniedError):  # the role is checked at every call too
        auth.identify("Bearer tok-a", "Drain")
    write_tokens(path, {"b": TOKENS["b"]})
    assert auth.reload() is True
    assert not auth._digests  # a reload forgets the kept headers (a revoked token's raw header is not held)
    with pytest.raises(UnauthenticatedError, match="unknown or revoked token"):
        auth.identify("Bearer tok-a", "AppendToken")
    assert auth.identify("bearer  tok-b ", "AppendToken").tenant == "b"


def test_unknown_tokens_are_not_kept_and_the_kept_are_bounded(tmp_path, monkeypatch) -> None:
    auth = Authenticator(str(write_tokens(tmp_path / "tokens.toml")), TenantLedger(8), 256)
    for i in range(50):
        with pytest.raises(UnauthenticatedError):
            auth.identify(f"Bearer guess-{i}", "AppendToken")
        with pytest.raises(UnauthenticatedError):
            auth.identify(f"Basic tok-a{i}", "AppendToken")
    assert not auth._digests
    monkeypatch.setattr(auth_module, "MAX_DIGESTS", 4)
    for i in range(10):
        assert auth.identify("Bearer tok-a" + " " * i, "AppendToken").tenant == "a"
        assert len(auth._digests) <= 4
