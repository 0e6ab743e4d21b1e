"""Which token and TLS files each part of a load-generator run calls with (docs/loadgen.md, "A secured server").

    without --tenants   every process: the token of --token-file FILE (a file holding one token; env
                        KVPOOL_TOKEN_FILE) or of KVPOOL_TOKEN
    --tenants N         process i: tenant i % N's token from --token-file ('TENANT TOKEN' lines, tenants.py)
    --admin-token-file  (env KVPOOL_ADMIN_TOKEN_FILE, or the token in KVPOOL_ADMIN_TOKEN): Stats of every tenant in
                        one call, and CheckInvariants at the end
    --tls-ca / --tls-cert / --tls-key: every connection (credentials.py)

No token is ever an argument (``--token X`` and ``--admin-token X`` are refused without repeating X), and none goes
into the summary. A --token-file is never silently ignored: without --tenants it is the one token of the run.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from kvpool_client import credentials
from kvpool_client.credentials import Credentials, CredentialsError
from kvpool_client.loadgen import tenants as tenancy

ENV_ADMIN_TOKEN, ENV_ADMIN_TOKEN_FILE = "KVPOOL_ADMIN_TOKEN", "KVPOOL_ADMIN_TOKEN_FILE"


@dataclass(frozen=True)
class RunCredentials:
    """What the run calls with: ``creds`` (TLS, and the one token without --tenants), the tenants' tokens, an admin
    token (None: none)."""

    creds: Credentials
    tenants: list[tuple[str, str]]
    admin_token: str | None

    @property
    def main_token(self) -> str | None:
        """The token of the driver's own calls (preflight, the end state): the admin's, else the first tenant's,
        else the run's."""
        return self.admin_token or (self.tenants[0][1] if self.tenants else self.creds.token)

    def worker_tokens(self, num_procs: int) -> list[str | None]:
        return [tenancy.worker_token(self.tenants, i, self.creds.token)[1] for i in range(num_procs)]

    def describe(self) -> str:
        """One line for the start of the run: where the tokens came from and whether TLS is on (no secret)."""
        if self.tenants:
            parts = [f"{len(self.tenants)} tenants' tokens from {self.creds.where.get('tenants')}"]
        else:
            parts = [f"token from {self.creds.where.get('token')}" if self.creds.token else "no token"]
        if self.admin_token:
            parts.append(f"admin token from {self.creds.where.get('admin')}")
        return ", ".join([*parts, self.creds.describe_tls()])

def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenants", type=int, default=0, metavar="N",
                   help="run as N tenants at once: process i calls with tenant i %% N's token from --token-file")
    p.add_argument("--token-file", default=os.environ.get(credentials.ENV_TOKEN_FILE), metavar="FILE",
                   help="without --tenants: a file holding the token of every process (or the token in "
                   "KVPOOL_TOKEN); with --tenants N: one 'TENANT TOKEN' per line, N lines at least "
                   "(env KVPOOL_TOKEN_FILE)")
    p.add_argument("--admin-token-file", default=os.environ.get(ENV_ADMIN_TOKEN_FILE), metavar="FILE",
                   help="a file holding an admin token (or the token in KVPOOL_ADMIN_TOKEN): Stats of every "
                   "tenant in one call, and CheckInvariants at the end (env KVPOOL_ADMIN_TOKEN_FILE)")
    credentials.refuse_secret_option(p, "--token")
    credentials.refuse_secret_option(p, "--admin-token", env=ENV_ADMIN_TOKEN)
    credentials.add_options(p, token_file=False)


def resolve(a: argparse.Namespace, env: dict[str, str] | None = None) -> RunCredentials:
    """Read every token and TLS file the options name; CredentialsError or TokenFileError (never showing a
    secret) when one cannot be used."""
    env = dict(os.environ if env is None else env)
    env.pop(credentials.ENV_TOKEN_FILE, None)  # --token-file's default already holds it
    tenants: list[tuple[str, str]] = []
    if a.tenants:
        tenants = tenancy.read_token_file(a.token_file, a.tenants)
        env.pop(credentials.ENV_TOKEN, None)  # each process calls with its tenant's token
    creds = credentials.from_values(None if a.tenants else a.token_file, a.tls_ca, a.tls_cert, a.tls_key,
                                    a.tls_server_name, env)
    where = dict(creds.where)
    if a.tenants:
        where["tenants"] = a.token_file
    admin = None
    if a.admin_token_file:
        admin, where["admin"] = credentials.read_token_file(a.admin_token_file), a.admin_token_file
    elif env.get(ENV_ADMIN_TOKEN, "").strip():
        admin, where["admin"] = env[ENV_ADMIN_TOKEN].strip(), ENV_ADMIN_TOKEN
        if len(admin.split()) != 1:
            raise CredentialsError(f"{ENV_ADMIN_TOKEN} must hold one token")
    creds = Credentials(creds.token, creds.tls_ca, creds.tls_cert, creds.tls_key, creds.tls_server_name, where)
    return RunCredentials(creds, tenants, admin)
