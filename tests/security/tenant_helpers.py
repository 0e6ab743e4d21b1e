"""Tokens files and raw stubs that call as a tenant (tests/security)."""

from __future__ import annotations

from pathlib import Path

import grpc

from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_server.service.auth import hash_token

TOKENS = {"a": ("tok-a", "frontend"), "b": ("tok-b", "frontend"), "ops": ("tok-admin", "admin")}


def write_tokens(path: Path, tokens: dict[str, tuple[str, str]] = TOKENS, tenants: str = "") -> Path:
    """A tokens file: ``tokens`` tenant -> (token, role), plus raw TOML ``tenants`` sections (an empty section for
    each tenant of ``tokens`` that ``tenants`` leaves out: the server refuses a token of an undefined tenant)."""
    lines = [f"[tenants.{tenant}]" for tenant in tokens if f"[tenants.{tenant}]" not in tenants] + [tenants]
    for tenant, (token, role) in tokens.items():
        lines += ["[[tokens]]", f'sha256 = "{hash_token(token)}"', f'tenant = "{tenant}"', f'role = "{role}"', ""]
    path.write_text("\n".join(lines))
    return path


class As:
    """A stub whose every call carries ``token`` (None: no authorization metadata)."""

    def __init__(self, channel: grpc.Channel, token: str | None) -> None:
        self.stub = pb_grpc.KVPoolServiceStub(channel)
        self.metadata = () if token is None else (("authorization", f"Bearer {token}"),)

    def __getattr__(self, rpc: str):
        method = getattr(self.stub, rpc)
        return lambda request, **kw: method(request, metadata=self.metadata, timeout=10, **kw)


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
