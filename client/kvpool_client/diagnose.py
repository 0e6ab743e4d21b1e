"""What went wrong when a client could not reach its server, said as it happened: the tools (kvctl,
kvpool-loadgen) and the library (``KVPoolClient`` raises ``ConnectionFailedError`` with the same message).

gRPC reports every failure to connect as UNAVAILABLE with a string; ``explain`` turns the string into the cause and
what to do: nothing listening, a socket file missing or not a socket's, a path given without ``unix:``, a TLS
server spoken to in plaintext (or the reverse), a certificate the other side does not trust, a host name the
server's certificate does not carry, an HTTP/1 port (the metrics port) given as the target. The fix is named in the
caller's words (``Hints``: the tools' flags, or the library's arguments). ``probe`` makes one Health call (it needs
no token) and fails at once -- no wait -- when the failure is one that waiting cannot cure.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc



@dataclass(frozen=True)
class Hints:
    """How the caller names each fix: the tools' flags or the library's arguments."""

    target: str  # how to give the server's address
    tls: str  # how to speak TLS (and give a client certificate)
    no_tls: str  # how to speak plaintext
    client_cert: str  # how to give a client certificate
    ca: str  # how to give the CA that signed the server's certificate
    server_name: str  # how to name the host the server's certificate carries
    unix: str  # how to name a unix socket PATH ({path})


FLAGS = Hints(
    target="give the server's address as --target HOST:PORT or unix:PATH (env KVPOOL_TARGET)",
    tls="--tls-ca PEM (and --tls-cert/--tls-key when it asks for a client certificate)",
    no_tls="leave out --tls-ca, --tls-cert and --tls-key",
    client_cert="--tls-cert and --tls-key",
    ca="--tls-ca",
    server_name="--tls-server-name NAME",
    unix="unix:{path} (or --unix-socket {path})",
)
LIBRARY = Hints(
    target='give the server\'s address as KVPoolClient("HOST:PORT") or KVPoolClient("unix:PATH")',
    tls="tls_ca=PEM (and tls_cert=/tls_key= when it asks for a client certificate)",
    no_tls="leave out tls_ca, tls_cert and tls_key",
    client_cert="tls_cert= and tls_key=",
    ca="tls_ca=",
    server_name='options=[("grpc.ssl_target_name_override", NAME)]',
    unix='"unix:{path}"',
)
TARGET_HELP = FLAGS.target  # kept for the tools that print it themselves
TLS_HELP = FLAGS.tls

# Substrings of gRPC's details that mean the connection itself failed (never a status the server sent).
_CONNECT_FAILURES = ("failed to connect", "socket closed", "connection reset", "handshake", "failed parsing http/2",
                     "errors resolving", "connection refused", "connect failed", "dns resolution")


def is_connect_failure(details: str) -> bool:
    """Whether an UNAVAILABLE with these details is a failure to connect (not one the server answered with)."""
    low = details.lower()
    return any(marker in low for marker in _CONNECT_FAILURES)


@dataclass(frozen=True)
class Problem:
    message: str
    permanent: bool  # waiting will not cure it (a TLS mismatch, a path without unix:), as opposed to "not yet up"


def path_target(target: str) -> str | None:
    """The socket path when ``target`` is a filesystem path given without ``unix:`` (else None)."""
    if target.startswith(("/", "./", "../", "~")) or (os.sep in target and ":" not in target):
        return target
    return None


def path_message(target: str, hints: Hints = FLAGS) -> str | None:
    """What to write instead when ``target`` is a socket path without ``unix:`` (else None)."""
    path = path_target(target)
    if path is None:
        return None
    return f"{target} is a path, not an address: a unix socket is named {hints.unix.format(path=path)}"


def check_target(target: str) -> None:
    """ValueError for a target that cannot be what was meant (a socket path without ``unix:``)."""
    message = path_message(target)
    if message is not None:
        raise ValueError(f"--target {message}")


def explain(target: str, details: str, tls: bool, hints: Hints = FLAGS, server_name: str | None = None) -> Problem:
    """The cause of a failed connection to ``target`` from gRPC's ``details``; ``tls``: whether we spoke TLS;
    ``server_name``: the name the server's certificate was checked against, when one was given."""
    low = details.lower()
    if (message := path_message(target, hints)) is not None:
        return Problem(message, True)
    if target.startswith("unix:"):
        path = target.removeprefix("unix:").removeprefix("//")
        return _unix_problem(path, low, hints)
    if "wrong_version_number" in low:
        return Problem(f"the server at {target} does not speak TLS (a plaintext port): {hints.no_tls}", True)
    if "certificate_verify_failed" in low:
        return Problem(f"the server at {target} presented a certificate that the CA given with {hints.ca} did not "
                       f"sign (or no {hints.ca} was given and the system's CAs do not trust it): give the CA that "
                       "signed the server's certificate", True)
    if "hostname verification" in low or ("peer name" in low and "not in peer certificate" in low):
        named = f"the name {server_name!r}" if server_name else f"the host of {target}"
        return Problem(f"the server's certificate does not carry {named}: connect by a name it carries, "
                       f"or give {hints.server_name} with one", True)
    if "failed parsing http/2" in low:
        return Problem(f"{target} answered in HTTP/1, not gRPC: is it the metrics port (--metrics-address, "
                       f"Prometheus)? Give kvpool-server's gRPC address (its --address); {hints.target}", True)
    if "socket closed" in low or "connection reset" in low:
        if not tls:
            return Problem(f"the server at {target} closed the connection at once: it serves TLS (a plaintext "
                           f"client cannot talk to it): give {hints.tls}", True)
        return Problem(f"the server at {target} closed the TLS handshake: it asks for a client certificate (mutual "
                       f"TLS) signed by its client CA (--tls-client-ca): give {hints.client_cert} of one", True)
    if "connection refused" in low:
        return Problem(f"nothing listens at {target} (connection refused): is kvpool-server running, on this "
                       f"address? {hints.target}", False)
    if "errors resolving" in low or ("dns" in low and "not found" in low):
        return Problem(f"cannot resolve the host of {target} ({details}); {hints.target}", True)
    if "deadline" in low:
        return Problem(f"nothing answered at {target} in time (a firewall, a wrong host, or a server too busy to "
                       f"accept): {hints.target}", False)
    return Problem(f"cannot reach a kvpool-server at {target}: {details}; {hints.target}", False)


def _unix_problem(path: str, low: str, hints: Hints = FLAGS) -> Problem:
    """A missing socket or a refused one may be a server still starting; the rest waiting does not cure."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return Problem(f"no unix socket at {path} (no such file): is kvpool-server running with --unix-socket "
                       f"{path}? {hints.target}", False)
    except PermissionError:
        return Problem(f"cannot look at {path}: no permission to its directory", True)
    if not stat.S_ISSOCK(mode):
        return Problem(f"{path} is not a unix socket (a {_kind(mode)}): {hints.target}", True)
    if "permission denied" in low:
        return Problem(f"no permission to connect to {path}: the server makes it 0660 with --unix-socket-group "
                       "(else 0600): join that group, or run as the server's user", True)
    if "connection refused" in low:
        return Problem(f"nothing listens on {path} (connection refused): a socket left by a server that is gone?",
                       False)
    return Problem(f"cannot connect to {path}: {low}", False)


def _kind(mode: int) -> str:
    return "directory" if stat.S_ISDIR(mode) else "regular file" if stat.S_ISREG(mode) else "special file"


def probe(channel: grpc.Channel, target: str, timeout: float, tls: bool,
          server_name: str | None = None) -> Problem | None:
    """One Health call on ``channel``: None when the server answered (whatever its status), else the Problem."""
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError as error:
        code = error.code() if hasattr(error, "code") else None
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return None  # something answered: an error of the call, not of the connection
        details = (error.details() if hasattr(error, "details") else "") or str(error)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            details = f"deadline of {timeout:g} s passed"
        return explain(target, details, tls, server_name=server_name)
    return None
