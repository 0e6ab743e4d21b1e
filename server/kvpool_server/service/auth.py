"""Who is calling: bearer tokens -> (tenant, role), from a tokens file the server re-reads on SIGHUP.

Every KVPoolService call carries ``authorization: Bearer <token>`` in its metadata when the server runs with
``--auth-tokens FILE``; the call scope (scope.py) asks ``Authenticator.identify`` for every call and every stream
message (a token revoked by SIGHUP stops working on the streams it opened, too) and hands the ``Identity`` to the
service. Without the flag every caller is ``ANONYMOUS``: tenant 0, every role, as before tenants existed.

The tokens file (TOML) keeps only SHA-256 digests of tokens (``kvpool-token hash TOKEN`` prints one; ``kvpool-token
new`` makes a random token and its digest)::

    [tenants.alpha]
    max_blocks = "25%"        # or a number of blocks
    max_sequences = 512
    max_sessions = 8
    reserved_blocks = 64      # blocks no other tenant may take
    may_attach = false        # DescribePool answers the shm name / CUDA IPC handle only to tenants that may attach
    share_prefixes = false    # may register public prefixes, shared with the other tenants that may (issue #13)

    [[tokens]]
    sha256 = "<64 hex digits>"
    tenant = "alpha"
    role = "frontend"         # or "admin"

Roles: ``frontend`` uses its own tenant's sessions and sequences; ``admin`` also may call ``ADMIN_RPCS`` (and sees
every tenant in Stats). Errors: no or unknown token -> UNAUTHENTICATED; a frontend calling an admin RPC, or a
tenant without ``share_prefixes`` registering a public prefix (``check_may_share_prefixes``) -> PERMISSION_DENIED
(``errors.py``).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import sys
import tomllib
from dataclasses import dataclass, field
from typing import Any

from kvpool_server.core.tenants import TenantLedger, TenantLimits
from kvpool_server.service.errors import PermissionDeniedError, UnauthenticatedError

logger = logging.getLogger(__name__)
ROLES = ("frontend", "admin")
ADMIN_RPCS = frozenset({"ListSessions", "ListSequences", "CheckInvariants", "Drain", "SubscribeEvents"})


@dataclass(frozen=True)
class Identity:
    tenant: str
    tenant_id: int | None  # None: no authentication (the server checks nobody's tenant)
    role: str
    may_attach: bool = True
    may_share_prefixes: bool = True

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


ANONYMOUS = Identity("", None, "admin", may_attach=True, may_share_prefixes=True)
def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class TenantPolicy:
    limits: TenantLimits = TenantLimits()
    may_attach: bool = False
    share_prefixes: bool = False


@dataclass
class TokensFile:
    tokens: dict[str, tuple[str, str]] = field(default_factory=dict)  # sha256 hex -> (tenant, role)
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)


class TokensFileError(ValueError):
    pass


def _blocks(value: Any, num_blocks: int, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.endswith("%"):
        return int(num_blocks * float(value[:-1]) / 100)
    if isinstance(value, int) and value >= 0:
        return value
    raise TokensFileError(f"{where} must be a number of blocks or a share such as \"25%\", got {value!r}")


def load_tokens_file(path: str, num_blocks: int) -> TokensFile:
    """Parse and check the tokens file; raises TokensFileError naming the problem."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TokensFileError(f"cannot read tokens file {path}: {exc}") from exc
    out = TokensFile()
    for name, spec in data.get("tenants", {}).items():
        where = f"{path}: tenants.{name}"
        limits = TenantLimits(
            max_blocks=_blocks(spec.get("max_blocks"), num_blocks, f"{where}.max_blocks"),
            max_sequences=spec.get("max_sequences"), max_sessions=spec.get("max_sessions"),
            reserved_blocks=_blocks(spec.get("reserved_blocks", 0), num_blocks, f"{where}.reserved_blocks") or 0,
        )
        out.tenants[name] = TenantPolicy(limits, bool(spec.get("may_attach", False)),
                                         bool(spec.get("share_prefixes", False)))
    for i, entry in enumerate(data.get("tokens", [])):
        digest, tenant, role = entry.get("sha256", ""), entry.get("tenant", ""), entry.get("role", "frontend")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise TokensFileError(f"{path}: tokens[{i}].sha256 must be 64 hex digits (kvpool-token hash TOKEN)")
        if not tenant or role not in ROLES:
            raise TokensFileError(f"{path}: tokens[{i}] needs a tenant and a role in {ROLES}")
        out.tokens[digest.lower()] = (tenant, role)
        out.tenants.setdefault(tenant, TenantPolicy())
    return out


class Authenticator:
    """The tokens of ``path``, applied to the manager's TenantLedger (tenant ids and limits). ``reload()`` swaps
    them in one assignment; on a bad file it keeps the old ones and logs why."""

    def __init__(self, path: str, ledger: TenantLedger, num_blocks: int) -> None:
        self.path = path
        self.ledger = ledger
        self.num_blocks = num_blocks
        self.identities: dict[str, Identity] = {}
        self.policies: dict[str, TenantPolicy] = {}
        self.load()

    def load(self) -> None:
        """Read the file and apply it (call under the servicer's lock: it changes the ledger)."""
        parsed = load_tokens_file(self.path, self.num_blocks)
        for name, policy in parsed.tenants.items():
            self.ledger.set_limits(self.ledger.tenant_id(name), policy.limits)
        self.policies = parsed.tenants
        self.identities = {
            digest: Identity(tenant, self.ledger.tenant_id(tenant), role, parsed.tenants[tenant].may_attach,
                             parsed.tenants[tenant].share_prefixes)
            for digest, (tenant, role) in parsed.tokens.items()
        }

    def reload(self) -> bool:
        try:
            self.load()
        except TokensFileError as exc:
            logger.error("SIGHUP: %s; keeping the tokens loaded before", exc)
            return False
        logger.info("SIGHUP: reloaded %d tokens of %d tenants from %s", len(self.identities), len(self.policies),
                    self.path)
        return True

    def identify(self, header: str | None, rpc: str) -> Identity:
        """The caller of ``rpc`` from its ``authorization`` header ("Bearer <token>", None when absent); raises
        UnauthenticatedError or PermissionDeniedError."""
        if header is None:
            raise UnauthenticatedError(f"{rpc}: no 'authorization: Bearer <token>' metadata (this server has "
                                       "--auth-tokens)")
        scheme, _, token = header.partition(" ")
        identity = self.identities.get(hash_token(token.strip())) if scheme.lower() == "bearer" else None
        if identity is None:
            raise UnauthenticatedError(f"{rpc}: unknown or revoked token")
        if rpc in ADMIN_RPCS and not identity.is_admin:
            raise PermissionDeniedError(f"{rpc} needs the admin role; tenant {identity.tenant!r} is a frontend")
        return identity


def check_may_share_prefixes(identity: Identity, public_prefix_len: int) -> None:
    """A public prefix (``public_prefix_len`` > 0) needs the tenant's ``share_prefixes``: its blocks are read by
    other tenants, and a match tells it that another tenant cached the prefix (docs/security.md)."""
    if public_prefix_len and not identity.may_share_prefixes:
        raise PermissionDeniedError(
            f"RegisterSequence public_prefix_len={public_prefix_len}: tenant {identity.tenant!r} may not share "
            "prefixes (share_prefixes = true in its tokens-file section)"
        )


def main(argv: list[str] | None = None) -> None:
    """``kvpool-token hash TOKEN`` (or the token on stdin): its sha256 line for the tokens file;
    ``kvpool-token new``: a random token, then its digest."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["new"]:
        token = secrets.token_urlsafe(32)
        print(token)
        print(hash_token(token))
    elif args[:1] == ["hash"]:
        token = args[1] if len(args) > 1 else sys.stdin.readline().strip()
        print(hash_token(token))
    else:
        print("usage: kvpool-token hash TOKEN | kvpool-token new", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
