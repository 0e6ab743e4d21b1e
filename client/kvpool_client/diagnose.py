"""What went wrong when a client tool could not reach its server, said as it happened (kvctl, kvpool-loadgen).

gRPC reports every failure to connect as UNAVAILABLE with a string; ``explain`` turns the string into the cause and
what to do: nothing listening, a socket file missing or not a socket's, a path given without ``unix:``, a TLS
server spoken to in plaintext (or the reverse), a certificate the other side does not trust, a host name the
server's certificate does not carry. ``probe`` makes one Health call (it needs no token) and fails at once -- no
wait -- when the failure is one that waiting cannot cure.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TARGET_HELP = "give the server's address as --target HOST:PORT or unix:PATH (env KVPOOL_TARGET)"
TLS_HELP = "--tls-ca PEM (and --tls-cert/--tls-key when it asks for a client certificate)"


@dataclass(frozen=True)
class Problem:
    message: str
    permanent: bool  # waiting will not cure it (a TLS mismatch, a path without unix:), as opposed to "not yet up"


def path_target(target: str) -> str | None:
    """The socket path when ``target`` is a filesystem path given without ``unix:`` (else None)."""
    if target.startswith(("/", "./", "../", "~")) or (os.sep in target and ":" not in target):
        return target
    return None


def check_target(target: str) -> None:
    """ValueError for a target that cannot be what was meant (a socket path without ``unix:``)."""
    path = path_target(target)
    if path is not None:
        raise ValueError(f"--target {target} is a path: a unix socket is named unix:{path} (or --unix-socket {path})")


def explain(target: str, details: str, tls: bool) -> Problem:
    """The cause of a failed connection to ``target`` from gRPC's ``details``; ``tls``: whether we spoke TLS."""
    low = details.lower()
    if path_target(target) is not None:
        return Problem(f"{target} is a path, not an address: a unix socket is named unix:{target}", True)
    if target.startswith("unix:"):
        path = target.removeprefix("unix:").removeprefix("//")
        return _unix_problem(path, low)
    if "wrong_version_number" in low:
        return Problem(f"the server at {target} does not speak TLS (a plaintext port): leave out --tls-ca, "
                       "--tls-cert and --tls-key", True)
    if "certificate_verify_failed" in low:
        return Problem(f"the server at {target} presented a certificate that the CA given with --tls-ca did not "
                       "sign (or no --tls-ca was given and the system's CAs do not trust it): give the CA that "
                       "signed the server's certificate", True)
    if "hostname verification" in low or ("peer name" in low and "not in peer certificate" in low):
        return Problem(f"the server's certificate does not name the host of {target}: connect by a name it carries, "
                       "or give --tls-server-name NAME", True)
    if "socket closed" in low or "connection reset" in low:
        if not tls:
            return Problem(f"the server at {target} closed the connection at once: it serves TLS (a plaintext "
                           f"client cannot talk to it): give {TLS_HELP}", True)
        return Problem(f"the server at {target} closed the TLS handshake: it asks for a client certificate (mutual "
                       "TLS) signed by its client CA (--tls-client-ca): give --tls-cert and --tls-key of one", True)
    if "connection refused" in low:
        return Problem(f"nothing listens at {target} (connection refused): is kvpool-server running, on this "
                       f"address? {TARGET_HELP}", False)
    if "errors resolving" in low or ("dns" in low and "not found" in low):
        return Problem(f"cannot resolve the host of {target} ({details}); {TARGET_HELP}", True)
    if "deadline" in low:
        return Problem(f"nothing answered at {target} in time (a firewall, a wrong host, or a server too busy to "
                       f"accept): {TARGET_HELP}", False)
    return Problem(f"cannot reach a kvpool-server at {target}: {details}; {TARGET_HELP}", False)


def _unix_problem(path: str, low: str) -> Problem:
    """A missing socket or a refused one may be a server still starting; the rest waiting does not cure."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return Problem(f"no unix socket at {path} (no such file): is kvpool-server running with --unix-socket "
                       f"{path}? {TARGET_HELP}", False)
    except PermissionError:
        return Problem(f"cannot look at {path}: no permission to its directory", True)
    if not stat.S_ISSOCK(mode):
        return Problem(f"{path} is not a unix socket (a {_kind(mode)}): {TARGET_HELP}", True)
    if "permission denied" in low:
        return Problem(f"no permission to connect to {path}: the server makes it 0660 with --unix-socket-group "
                       "(else 0600): join that group, or run as the server's user", True)
    if "connection refused" in low:
        return Problem(f"nothing listens on {path} (connection refused): a socket left by a server that is gone?",
                       False)
    return Problem(f"cannot connect to {path}: {low}", False)


def _kind(mode: int) -> str:
    return "directory" if stat.S_ISDIR(mode) else "regular file" if stat.S_ISREG(mode) else "special file"


def probe(channel: grpc.Channel, target: str, timeout: float, tls: bool) -> Problem | None:
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
        return explain(target, details, tls)
    return None
