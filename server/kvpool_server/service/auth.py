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

Every token's tenant needs its ``[tenants.<name>]`` section (it may be empty). The whole schema, checked at start
(StartupError) and on every SIGHUP (a bad file is logged and the old tokens stay), is in ``tokens_file.py``.

Roles: ``frontend`` uses its own tenant's sessions and sequences; ``admin`` also may call ``ADMIN_RPCS`` (and sees
every tenant in Stats). Errors: no or unknown token -> UNAUTHENTICATED; a frontend calling an admin RPC, or a
tenant without ``share_prefixes`` registering a public prefix (``check_may_share_prefixes``) -> PERMISSION_DENIED
(``errors.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
import sys
from dataclasses import dataclass

from kvpool_server.core.tenants import TenantLedger
from kvpool_server.service.errors import PermissionDeniedError, UnauthenticatedError
from kvpool_server.service.tokens_file import ROLES, TenantPolicy, TokensFile, TokensFileError, load_tokens_file

__all__ = ["ADMIN_RPCS", "ANONYMOUS", "ROLES", "Authenticator", "Identity", "TenantPolicy", "TokensFile",
           "TokensFileError", "check_may_share_prefixes", "hash_token", "load_tokens_file"]
logger = logging.getLogger(__name__)
ADMIN_RPCS = frozenset({"ListSessions", "ListSequences", "CheckInvariants", "Drain", "SubscribeEvents"})
MAX_DIGESTS = 4096  # known tokens' headers whose digest is kept (``Authenticator.identify``)


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


class Authenticator:
    """The tokens of ``path``, applied to the manager's TenantLedger (tenant ids and limits). The file is checked
    whole against its schema (``tokens_file.py``) before anything is applied: ``load()`` raises TokensFileError at
    start; ``reload()`` (SIGHUP) swaps the tokens in one assignment, or on a bad file keeps the old tokens and limits,
    logs why and returns False -- it never raises."""

    def __init__(self, path: str, ledger: TenantLedger, num_blocks: int) -> None:
        self.path = path
        self.ledger = ledger
        self.num_blocks = num_blocks
        self.identities: dict[str, Identity] = {}
        self.policies: dict[str, TenantPolicy] = {}
        # header -> its token's digest, for headers whose token was known when first seen: a fast-path channel's
        # every record (and a stream's every message) carries the same header, and its sha256 is a pure function
        # of it -- the digest is still looked up in ``identities`` at every call, so a revoked token is refused at
        # its next one. Unknown tokens are never kept (no one fills it by guessing); at most MAX_DIGESTS entries.
        self._digests: dict[str, str] = {}
        self.load()

    def load(self) -> None:
        """Read and check the file, then apply it (call under the servicer's lock: it changes the ledger). A tenant
        dropped from the file keeps its quotas (its sequences live on) but no longer reserves blocks."""
        parsed = load_tokens_file(self.path, self.num_blocks)
        self.apply(parsed)

    def apply(self, parsed: TokensFile) -> None:
        for name in self.policies.keys() - parsed.tenants.keys():
            tenant = self.ledger.tenant_id(name)
            self.ledger.set_limits(tenant, dataclasses.replace(self.ledger.limits[tenant], reserved_blocks=0))
        for name, policy in parsed.tenants.items():
            self.ledger.set_limits(self.ledger.tenant_id(name), policy.limits)
        self.policies = parsed.tenants
        self.identities = {
            digest: Identity(tenant, self.ledger.tenant_id(tenant), role, parsed.tenants[tenant].may_attach,
                             parsed.tenants[tenant].share_prefixes)
            for digest, (tenant, role) in parsed.tokens.items()
        }
        self._digests = {}  # a reload forgets every kept header: a revoked token's is not held on to

    def reload(self) -> bool:
        """SIGHUP: re-read the file. True once applied; False (the old tokens and limits kept, the reason logged)
        if it cannot be read or breaks the schema. Never raises: an exception here would end the server."""
        try:
            parsed = load_tokens_file(self.path, self.num_blocks)
        except TokensFileError as exc:
            logger.error("SIGHUP: tokens file rejected, keeping the tokens loaded before: %s", exc)
            return False
        except Exception:  # a defect in the checker: still keep serving with the old tokens
            logger.exception("SIGHUP: cannot check tokens file %s, keeping the tokens loaded before", self.path)
            return False
        self.apply(parsed)
        logger.info("SIGHUP: reloaded %s: %s", self.path, self.summary())
        return True

    def summary(self) -> str:
        """One line for the start log, e.g. ``auth on: 3 tokens (1 admin), 2 tenants``."""
        admins = sum(identity.is_admin for identity in self.identities.values())
        return (f"auth on: {len(self.identities)} token{'s' * (len(self.identities) != 1)} ({admins} admin), "
                f"{len(self.policies)} tenant{'s' * (len(self.policies) != 1)}")

    def identify(self, header: str | None, rpc: str) -> Identity:
        """The caller of ``rpc`` from its ``authorization`` header ("Bearer <token>", None when absent); raises
        UnauthenticatedError or PermissionDeniedError."""
        if header is None:
            raise UnauthenticatedError(f"{rpc}: no 'authorization: Bearer <token>' metadata (this server has "
                                       "--auth-tokens)")
        digest = self._digests.get(header)
        if digest is None:
            scheme, _, token = header.partition(" ")
            digest = hash_token(token.strip()) if scheme.lower() == "bearer" else ""
            if digest in self.identities:
                if len(self._digests) >= MAX_DIGESTS:
                    self._digests.clear()
                self._digests[header] = digest
        identity = self.identities.get(digest)
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
    if args[:1] in (["-h"], ["--help"]):
        print("usage: kvpool-token hash TOKEN | kvpool-token new\n\n"
              "  new         print a random token, then its sha256 line for the server's tokens file\n"
              "  hash TOKEN  print the sha256 line of TOKEN (or of the token on stdin's first line)\n\n"
              "The tokens file (kvpool-server --auth-tokens) holds the sha256 lines only: docs/security.md.")
        return
    if args[:1] == ["new"]:
        token = secrets.token_urlsafe(32)
        print(token)
        print(hash_token(token))
    elif args[:1] == ["hash"]:
        token = args[1] if len(args) > 1 else sys.stdin.readline().strip()
        if not token or len(token.split()) != 1:
            what = "an empty token" if not token else "a token with spaces in it"
            print(f"kvpool-token hash: {what}: give the token as the argument or on stdin's first line (the digest "
                  "of an empty string would match no client's token)", file=sys.stderr)
            sys.exit(2)
        print(hash_token(token))
    else:
        print("usage: kvpool-token hash TOKEN | kvpool-token new", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
