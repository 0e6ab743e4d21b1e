#!/usr/bin/env python3
"""Container health check for kvpool-server: exit 0 when gRPC health checking answers SERVING, else 1.

Docker runs it inside the server container (the image's HEALTHCHECK and docker/compose.yaml's ``healthcheck``), so
by default it asks the server it sits beside, found from the server's own settings:

* ``argv[1]`` if given (any gRPC target: ``127.0.0.1:50051``, ``unix:/run/kvpool/kvpool.sock``), else
* ``KVPOOL_HEALTH_TARGET``, else
* the unix socket ``KVPOOL_UNIX_SOCKET`` when set (no network involved), else
* ``KVPOOL_ADDRESS`` with a wildcard host (``0.0.0.0``, ``[::]``, empty) replaced by loopback.

``KVPOOL_HEALTH_SERVICE`` names the service to ask about (default ``""``: the server as a whole);
``KVPOOL_HEALTH_TIMEOUT_S`` is the deadline of the one call (default 3 s). One line goes to stdout, which Docker keeps
in ``docker inspect``'s health log. Standard library plus grpcio and grpcio-health-checking only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 3.0
_WILDCARD_HOSTS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}


class TargetError(ValueError):
    """The settings name no address a health check can reach."""


def loopback_target(address: str) -> str:
    """``0.0.0.0:50051`` -> ``127.0.0.1:50051``; ``[::]:50051`` -> ``[::1]:50051``; other hosts stay."""
    host, sep, port = address.rpartition(":")
    if not sep:
        raise TargetError(f"address {address!r} is not HOST:PORT")
    if not port.isdigit() or int(port) == 0:
        raise TargetError(f"address {address!r} has no fixed port to check")
    return f"{_WILDCARD_HOSTS.get(host, host)}:{port}"


def health_target(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """The gRPC target to check, by the precedence in the module docstring."""
    if argv:
        return argv[0]
    if environ.get("KVPOOL_HEALTH_TARGET"):
        return environ["KVPOOL_HEALTH_TARGET"]
    socket_path = environ.get("KVPOOL_UNIX_SOCKET")
    if socket_path:
        return "unix:" + socket_path
    address = environ.get("KVPOOL_ADDRESS", DEFAULT_ADDRESS)
    if not address:
        raise TargetError("neither KVPOOL_UNIX_SOCKET nor KVPOOL_ADDRESS is set")
    return loopback_target(address)


def check(target: str, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[bool, str]:
    """One Health/Check call: (serving?, what to print)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{target}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {status}"


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    try:
        target = health_target(argv, environ)
        timeout_s = float(environ.get("KVPOOL_HEALTH_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    except (TargetError, ValueError) as exc:
        print(f"healthcheck: {exc}", flush=True)
        return 1
    serving, line = check(target, environ.get("KVPOOL_HEALTH_SERVICE", ""), timeout_s)
    print(line, flush=True)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
