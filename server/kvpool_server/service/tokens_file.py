"""The tokens file's schema: ``load_tokens_file`` reads and checks the whole file, or raises TokensFileError.

The file (TOML, UTF-8, at most MAX_TOKENS_FILE_BYTES) holds two keys and nothing else::

    [tenants.<name>]          # a table of tables; <name>: 1-64 of A-Z a-z 0-9 . _ - (starting with a letter/digit)
    max_blocks = "25%"        # int >= 0 (blocks) or "N%" with 0 < N <= 100 (of the pool, rounded down)
    max_sequences = 512       # int >= 0
    max_sessions = 8          # int >= 0
    reserved_blocks = 64      # int >= 0 or "N%"; at most max_blocks; the tenants' sum at most the pool
    may_attach = false        # bool
    share_prefixes = false    # bool

    [[tokens]]                # an array of tables
    sha256 = "<64 hex digits>"   # required, unique in the file
    tenant = "<name>"            # required, a tenant defined under [tenants]
    role = "frontend"            # "frontend" (default) or "admin"

Every key is optional unless marked required; an unknown key (a misspelt ``[tenant.x]`` or ``max_block``), a value
of another type (``max_sequences = "many"``, ``may_attach = "false"``, ``sha256 = 5``), a value out of range, or a
token of an undefined tenant is an error naming the file, the key path and the problem: nothing is applied
(``Authenticator.load`` applies a file only once all of it is checked).
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from kvpool_server.core.tenants import TenantLimits
from kvpool_server.core.types import UNLIMITED

ROLES = ("frontend", "admin")
MAX_TOKENS_FILE_BYTES = 4 << 20  # read at most this much: a tokens file is a few KiB
TOP_KEYS = ("tenants", "tokens")
TENANT_KEYS = ("max_blocks", "max_sequences", "max_sessions", "reserved_blocks", "may_attach", "share_prefixes")
TOKEN_KEYS = ("sha256", "tenant", "role")
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SHA256 = re.compile(r"[0-9a-fA-F]{64}")
PERCENT = re.compile(r"(\d{1,3}(?:\.\d+)?)%")


class TokensFileError(ValueError):
    """The tokens file cannot be read or breaks its schema; the message names the file, the key and the problem."""


@dataclass
class TenantPolicy:
    limits: TenantLimits = TenantLimits()
    may_attach: bool = False
    share_prefixes: bool = False


@dataclass
class TokensFile:
    tokens: dict[str, tuple[str, str]] = field(default_factory=dict)  # sha256 hex (lower case) -> (tenant, role)
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)


def load_tokens_file(path: str, num_blocks: int) -> TokensFile:
    """Read ``path`` and check all of it against the schema above; raises TokensFileError (never anything else
    for a bad file) naming the problem. ``num_blocks``: the pool's, for "N%" and the reservations' sum."""
    return _Checker(path, num_blocks).check(_read(path))


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKENS_FILE_BYTES + 1)
    except OSError as exc:
        raise TokensFileError(f"cannot read tokens file {path}: {exc}") from exc
    if len(raw) > MAX_TOKENS_FILE_BYTES:
        raise TokensFileError(f"{path}: larger than {MAX_TOKENS_FILE_BYTES} bytes; is this the tokens file?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokensFileError(f"{path}: not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TokensFileError(f"{path}: not valid TOML: {exc}") from exc


class _Checker:
    def __init__(self, path: str, num_blocks: int) -> None:
        self.path = path
        self.num_blocks = num_blocks

    def fail(self, where: str, problem: str) -> TokensFileError:
        return TokensFileError(f"{self.path}: {where}: {problem}")

    def check(self, data: dict[str, Any]) -> TokensFile:
        self.keys(data, TOP_KEYS, "the top level")
        tenants = data.get("tenants", {})
        if not isinstance(tenants, dict):
            raise self.fail("tenants", f"must be a table of [tenants.<name>] sections, got {_show(tenants)}")
        out = TokensFile()
        for name, spec in tenants.items():
            out.tenants[name] = self.tenant(name, spec)
        reserved = sum(policy.limits.reserved_blocks for policy in out.tenants.values())
        if reserved > self.num_blocks:
            raise self.fail("tenants", f"the reserved_blocks sum to {reserved}, more than the pool's "
                                       f"{self.num_blocks} blocks")
        tokens = data.get("tokens", [])
        if not isinstance(tokens, list):
            raise self.fail("tokens", f"must be an array of [[tokens]] tables, got {_show(tokens)}")
        first_index: dict[str, int] = {}
        for i, entry in enumerate(tokens):
            digest, tenant, role = self.token(f"tokens[{i}]", entry, out.tenants)
            if digest in first_index:
                raise self.fail(f"tokens[{i}].sha256", f"the same digest as tokens[{first_index[digest]}]")
            first_index[digest] = i
            out.tokens[digest] = (tenant, role)
        return out

    def keys(self, table: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
        for key in table:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise self.fail(where, f"unknown key {key!r}{hint}; allowed: {', '.join(allowed)}")

    def tenant(self, name: str, spec: Any) -> TenantPolicy:
        where = f"tenants.{name}"
        if not TENANT_NAME.fullmatch(name):
            raise self.fail(where, "a tenant name is 1-64 of A-Z a-z 0-9 . _ - (starting with a letter or digit)")
        if not isinstance(spec, dict):
            raise self.fail(where, f"must be a table ([{where}] with its keys), got {_show(spec)}")
        self.keys(spec, TENANT_KEYS, where)
        max_blocks = self.blocks(spec, "max_blocks", where)
        reserved = self.blocks(spec, "reserved_blocks", where) or 0
        if reserved > self.num_blocks:
            raise self.fail(f"{where}.reserved_blocks", f"{reserved} is more than the pool's {self.num_blocks} "
                                                        "blocks")
        if max_blocks is not None and reserved > max_blocks:
            raise self.fail(f"{where}.reserved_blocks", f"{reserved} is more than its max_blocks ({max_blocks})")
        limits = TenantLimits(max_blocks=max_blocks, max_sequences=self.count(spec, "max_sequences", where),
                              max_sessions=self.count(spec, "max_sessions", where), reserved_blocks=reserved)
        return TenantPolicy(limits, self.flag(spec, "may_attach", where), self.flag(spec, "share_prefixes", where))

    def count(self, spec: dict[str, Any], key: str, where: str) -> int | None:
        value = spec.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < UNLIMITED:
            raise self.fail(f"{where}.{key}", f"must be a whole number >= 0, got {_show(value)}")
        return value

    def blocks(self, spec: dict[str, Any], key: str, where: str) -> int | None:
        value = spec.get(key)
        if isinstance(value, str):
            match = PERCENT.fullmatch(value)
            share = float(match.group(1)) if match else 0.0
            if not 0 < share <= 100:
                raise self.fail(f"{where}.{key}", f"a share of the pool is \"N%\" with 0 < N <= 100, got {value!r}")
            return int(self.num_blocks * share / 100)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < UNLIMITED):
            return value
        raise self.fail(f"{where}.{key}", f"must be a number of blocks (>= 0) or a share such as \"25%\", "
                                          f"got {_show(value)}")

    def flag(self, spec: dict[str, Any], key: str, where: str) -> bool:
        value = spec.get(key, False)
        if not isinstance(value, bool):
            raise self.fail(f"{where}.{key}", f"must be true or false (no quotes), got {_show(value)}")
        return value

    def token(self, where: str, entry: Any, tenants: dict[str, TenantPolicy]) -> tuple[str, str, str]:
        if not isinstance(entry, dict):
            raise self.fail(where, f"must be a [[tokens]] table, got {_show(entry)}")
        self.keys(entry, TOKEN_KEYS, where)
        digest, tenant, role = entry.get("sha256"), entry.get("tenant"), entry.get("role", "frontend")
        if not isinstance(digest, str) or not SHA256.fullmatch(digest):
            got = f"{len(digest)} characters" if isinstance(digest, str) else _show(digest)  # never echo: a token?
            raise self.fail(f"{where}.sha256", f"must be 64 hex digits (kvpool-token hash TOKEN), got {got}")
        if not isinstance(tenant, str):
            raise self.fail(f"{where}.tenant", f"must name a tenant, got {_show(tenant)}")
        if tenant not in tenants:
            defined = ", ".join(sorted(tenants)) or "none"
            raise self.fail(f"{where}.tenant", f"tenant {tenant!r} is not defined (add a [tenants.{tenant}] "
                                               f"section; defined: {defined})")
        if role not in ROLES:
            raise self.fail(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {_show(role)}")
        return digest.lower(), tenant, role


def _show(value: Any) -> str:
    """A value for an error message: its TOML type and, for a scalar, the value (never a whole table)."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {value!r}"
