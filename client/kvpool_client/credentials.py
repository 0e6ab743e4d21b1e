"""How every client tool (kvctl, kvpool-loadgen) finds its token and its TLS files: one set of options, one set of
environment variables, one rule for each (docs/ops.md, "A secured server").

    option                       environment                  what
    --token-file FILE            KVPOOL_TOKEN_FILE            a file holding the bearer token (one token)
                                 KVPOOL_TOKEN                 the token itself (an environment value)
    --tls-ca PEM                 KVPOOL_CLIENT_TLS_CA         TLS: trust the server certificates this CA signed
    --tls-cert PEM --tls-key PEM KVPOOL_CLIENT_TLS_CERT/_KEY  mutual TLS: this client's certificate and key
    --tls-server-name NAME       KVPOOL_CLIENT_TLS_SERVER_NAME the name to check the server certificate against
                                                              (default: the target's host)

A flag beats its variable; ``--token-file`` (or KVPOOL_TOKEN_FILE) beats KVPOOL_TOKEN. The client's TLS variables
are not the server's (KVPOOL_TLS_CERT is the *server's* certificate), so one environment can hold both. A unix:
target never uses TLS (``Credentials.for_target``): the server serves TLS on TCP only.

A token is never an argument: argv is in ``ps`` and the shell's history. ``--token X`` is refused with a message
that does not repeat X (``refuse_secret_option``), and no usage error repeats a value given to an option named like
a token (``SecretSafeParser``). Reading a token file never prints what the file holds.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

MAX_TOKEN_FILE_BYTES = 64 << 10  # a token file is one line; a bigger file is not a token file
ENV_TOKEN, ENV_TOKEN_FILE = "KVPOOL_TOKEN", "KVPOOL_TOKEN_FILE"
ENV_TLS = {"tls_ca": "KVPOOL_CLIENT_TLS_CA", "tls_cert": "KVPOOL_CLIENT_TLS_CERT", "tls_key": "KVPOOL_CLIENT_TLS_KEY",
           "tls_server_name": "KVPOOL_CLIENT_TLS_SERVER_NAME"}
NO_TOKEN_ARGUMENT = ("{option} is not taken on the command line: a token there shows in `ps` and in the shell's "
                     "history (the value you gave is not repeated here). Put it in a file readable only by you "
                     "and give --token-file FILE, or set {env}")


class CredentialsError(ValueError):
    """A token or TLS file that cannot be used; the message names the file and the problem, never a secret."""


@dataclass(frozen=True)
class Credentials:
    """A token and TLS material, read once (PEM bytes, so a spawned process gets them without reading files)."""

    token: str | None = None
    tls_ca: bytes | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_server_name: str | None = None
    where: dict[str, str] = field(default_factory=dict, compare=False)  # where each came from, for messages

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def for_target(self, target: str) -> Credentials:
        """These credentials for ``target``: a unix socket is never TLS (the server serves TLS on TCP only; the
        socket's file mode is its access control), so a TLS setting from the environment is left out for it."""
        if not target.startswith("unix:") or not self.tls:
            return self
        where = {k: v for k, v in self.where.items() if not k.startswith("tls")}
        return Credentials(self.token, None, None, None, None, where)

    def with_token(self, token: str | None) -> Credentials:
        return Credentials(token, self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name, self.where)

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of KVPoolClient / AsyncKVPoolClient."""
        kwargs: dict[str, Any] = {"token": self.token, "tls_ca": self.tls_ca, "tls_cert": self.tls_cert,
                                  "tls_key": self.tls_key}
        if self.tls_server_name:
            kwargs["options"] = self.channel_options()
        return kwargs

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name else []

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that carries the token (empty without one)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self, target: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A blocking channel to ``target``: TLS when a CA or a client certificate is set, else plaintext."""
        options = [*(options or []), *self.channel_options()]
        if not self.tls:
            return grpc.insecure_channel(target, options=options)
        creds = grpc.ssl_channel_credentials(root_certificates=self.tls_ca, private_key=self.tls_key,
                                             certificate_chain=self.tls_cert)
        return grpc.secure_channel(target, creds, options=options)

    def describe(self) -> str:
        """For a message: what this client sends ("token from FILE, TLS (CA FILE, client certificate FILE)")."""
        token = f"token from {self.where.get('token', ENV_TOKEN)}" if self.token else "no token"
        return f"{token}, {self.describe_tls()}"

    def describe_tls(self) -> str:
        if not self.tls:
            return "plaintext"
        tls = [f"CA {self.where.get('tls_ca', 'the system roots')}"]
        if self.tls_cert is not None:
            tls.append(f"client certificate {self.where.get('tls_cert', '?')}")
        return f"TLS ({', '.join(tls)})"


# ---------------------------------------------------------------------------------------------- reading
def read_token_file(path: str | Path) -> str:
    """The one token in ``path`` (surrounding whitespace and a final newline dropped). CredentialsError, naming the
    file, when it cannot be read, is empty, is too big, or holds more than one word (never showing the content)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as error:
        raise CredentialsError(f"cannot read the token file {path}: {error.strerror}") from None
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise CredentialsError(f"the token file {path} is over {MAX_TOKEN_FILE_BYTES >> 10} KiB: it holds one token")
    try:
        words = raw.decode().split()
    except UnicodeDecodeError:
        raise CredentialsError(f"the token file {path} is not UTF-8 text") from None
    if not words:
        raise CredentialsError(f"the token file {path} is empty: it should hold the token")
    if len(words) > 1:
        raise CredentialsError(f"the token file {path} holds {len(words)} words separated by spaces or lines; it "
                               "should hold one token (kvpool-loadgen --tenants N reads 'TENANT TOKEN' lines)")
    return words[0]


def _read_pem(path: str, what: str, flag: str = "") -> bytes:
    """A PEM file's bytes; CredentialsError when it cannot be read, is not PEM, or holds the other kind of PEM
    (a private key given as a certificate, or the reverse: gRPC would say only that it cannot connect)."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise CredentialsError(f"cannot read {what} {path}: {error.strerror}") from None
    if b"-----BEGIN" not in data:
        raise CredentialsError(f"{what} {path} is not PEM (no '-----BEGIN' line)")
    wants_key = flag == "--tls-key"
    has_key, has_cert = b"PRIVATE KEY-----" in data, b"-----BEGIN CERTIFICATE-----" in data
    if flag and wants_key and not has_key:
        raise CredentialsError(f"{flag} {path} holds no private key (a certificate?): give the client's key file")
    if flag and not wants_key and not has_cert:
        found = "a private key" if has_key else "no certificate"
        raise CredentialsError(f"{flag} {path} holds {found}, not a certificate: give {what}'s PEM file")
    return data


def from_values(token_file: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                tls_key: str | None = None, tls_server_name: str | None = None,
                env: Mapping[str, str] | None = None) -> Credentials:
    """Credentials from option values (None: not given), falling back on the environment (module docstring)."""
    env = os.environ if env is None else env
    where: dict[str, str] = {}
    token_file = token_file or env.get(ENV_TOKEN_FILE) or None
    token = None
    if token_file:
        token, where["token"] = read_token_file(token_file), token_file
    elif env.get(ENV_TOKEN):
        token = env[ENV_TOKEN].strip()
        if not token or len(token.split()) != 1:
            raise CredentialsError(f"{ENV_TOKEN} must hold one token (it has {len(token.split())} words)")
        where["token"] = ENV_TOKEN
    paths = {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key}
    for name, value in paths.items():
        paths[name] = value or env.get(ENV_TLS[name]) or None
    if (paths["tls_cert"] is None) != (paths["tls_key"] is None):
        given, missing = ("--tls-cert", "--tls-key") if paths["tls_cert"] else ("--tls-key", "--tls-cert")
        raise CredentialsError(f"{given} needs {missing}: a client certificate and its key go together (mutual TLS)")
    pems = {}
    for name, what in (("tls_ca", "the CA certificate"), ("tls_cert", "the client certificate"),
                       ("tls_key", "the client key")):
        path = paths[name]
        pems[name] = _read_pem(path, what, "--" + name.replace("_", "-")) if path else None
        if path:
            where[name] = path
    server_name = tls_server_name or env.get(ENV_TLS["tls_server_name"]) or None
    return Credentials(token, pems["tls_ca"], pems["tls_cert"], pems["tls_key"], server_name, where)


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Credentials:
    """Credentials from the options ``add_options`` declared."""
    return from_values(getattr(args, "token_file", None), args.tls_ca, args.tls_cert, args.tls_key,
                       args.tls_server_name, env)


# ---------------------------------------------------------------------------------------------- options
class SecretSafeParser(argparse.ArgumentParser):
    """An ArgumentParser whose error messages never repeat a value given to an option that looks like a token
    (``--tok...``, ``--admin-tok...``; not ``--token-file``): argparse repeats unrecognized or ambiguous arguments
    ("unrecognized arguments: --tokne X")."""

    _secrets: tuple[str, ...] = ()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._secrets = secret_words(sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> Any:
        for word in self._secrets:
            message = message.replace(word, "<hidden>")
        super().error(message)


def secret_words(argv: list[str]) -> tuple[str, ...]:
    """The values in ``argv`` given to an option that may carry a token (SecretSafeParser)."""
    words = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if not name.lstrip("-").replace("admin-", "", 1).startswith("tok") or not arg.startswith("--"):
            continue
        if name.endswith("-file"):
            continue
        if eq and value:
            words.append(value)
        elif i + 1 < len(argv) and not eq:
            words.append(argv[i + 1])
    return tuple(w for w in words if len(w) >= 3)  # a very short value would redact unrelated text


class _RefuseSecret(argparse.Action):
    """An option that would carry a secret: refused, naming the option and never its value."""

    def __init__(self, option_strings: list[str], dest: str, env: str = ENV_TOKEN, **kwargs: Any) -> None:
        self.env = env
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(NO_TOKEN_ARGUMENT.format(option=option_string, env=self.env))


def refuse_secret_option(parser: Any, option: str, env: str = ENV_TOKEN) -> None:
    """Declare ``option`` (``--token``) only to refuse it without echoing its value. Without it, argparse would
    take ``--token X`` as an abbreviation of ``--token-file`` or report "unrecognized arguments: --token X"."""
    parser.add_argument(option, action=_RefuseSecret, env=env, default=argparse.SUPPRESS)


def add_options(parser: argparse.ArgumentParser, *, suppress: bool = False, token_file: bool = True) -> None:
    """Declare the token and TLS options (module docstring). ``suppress``: no defaults (argparse.SUPPRESS), for
    the copy of the options a subcommand also takes; ``token_file=False``: the tool declares its own."""
    default = argparse.SUPPRESS if suppress else None
    group = parser.add_argument_group("a secured server (docs/security.md)")
    if token_file:
        group.add_argument("--token-file", metavar="FILE", default=default,
                           help=f"file holding the bearer token (env {ENV_TOKEN_FILE}; or the token in {ENV_TOKEN})")
        refuse_secret_option(group, "--token")
    group.add_argument("--tls-ca", metavar="PEM", default=default,
                       help=f"TLS: the CA that signed the server's certificate (env {ENV_TLS['tls_ca']})")
    group.add_argument("--tls-cert", metavar="PEM", default=default,
                       help=f"mutual TLS: this client's certificate (env {ENV_TLS['tls_cert']}); with --tls-key")
    group.add_argument("--tls-key", metavar="PEM", default=default,
                       help=f"mutual TLS: this client's private key (env {ENV_TLS['tls_key']})")
    group.add_argument("--tls-server-name", metavar="NAME", default=default,
                       help="check the server's certificate for this name instead of the target's host "
                       f"(env {ENV_TLS['tls_server_name']})")
