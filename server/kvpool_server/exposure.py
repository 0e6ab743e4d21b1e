"""Which addresses reach other hosts, and the rules for exposing them: the gRPC address, the metrics address and
the KV event endpoints (docs/security.md). Pure functions of the settings (``ServerConfig`` satisfies ``Exposure``),
except ``check_transport_files``, which looks for the files they name."""

from __future__ import annotations

import ipaddress
import os
from typing import Protocol


class Exposure(Protocol):
    """The settings these rules read (``config.ServerConfig``'s fields of the same names), read-only."""

    @property
    def address(self) -> str: ...
    @property
    def insecure(self) -> bool: ...
    @property
    def auth_tokens(self) -> str | None: ...
    @property
    def tls_cert(self) -> str | None: ...
    @property
    def tls_key(self) -> str | None: ...
    @property
    def tls_client_ca(self) -> str | None: ...
    @property
    def metrics_address(self) -> str: ...
    @property
    def kv_events_publish(self) -> str: ...
    @property
    def kv_events_replay(self) -> str: ...


class TransportError(Exception):
    """A listening or TLS setting that cannot work (config.py turns it into a ConfigError)."""


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_transport(config: Exposure) -> None:
    """Raise TransportError for TLS files given half-way, or a network address left open without --insecure: the
    gRPC address (no --auth-tokens and no TLS) or the metrics address (metrics have no authentication). Pure: that
    the files exist is ``check_transport_files``'."""
    if bool(config.tls_cert) != bool(config.tls_key):
        raise TransportError("--tls-cert and --tls-key go together")
    if config.tls_client_ca and not config.tls_cert:
        raise TransportError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    if config.insecure:
        return
    if config.address and not is_loopback(config.address.rsplit(":", 1)[0]):
        if not (config.auth_tokens or config.tls_cert):
            raise TransportError(
                f"--address {config.address} is reachable from other hosts, and there is neither --auth-tokens nor "
                "--tls-cert: anyone there could free or read every sequence. Add authentication and TLS "
                "(docs/security.md), listen on 127.0.0.1 or a unix socket, or pass --insecure to accept that"
            )
    for endpoint in (config.kv_events_publish, config.kv_events_replay):
        if exposed_endpoint(endpoint):
            raise TransportError(
                f"KV event endpoint {endpoint} is reachable from other hosts, and KV events have no "
                "authentication: anyone there could read every published block's token ids. Use 127.0.0.1 or an "
                "ipc:// path, or pass --insecure to accept that (docs/scale-out.md)")
    if exposed_metrics(config):
        raise TransportError(
            f"--metrics-address {config.metrics_address} is reachable from other hosts, and metrics have no "
            "authentication: anyone there could read every tenant's name and usage. Serve them on 127.0.0.1 (a "
            "scraper elsewhere: through a tunnel or an authenticating proxy), or pass --insecure to accept that "
            "(docs/security.md)"
        )


def check_transport_files(config: Exposure) -> None:
    """Raise TransportError for a TLS or tokens file that is not there."""
    for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_tokens"):
        path = getattr(config, name)
        if path and not os.path.isfile(path):
            raise TransportError(f"--{name.replace('_', '-')} {path}: no such file")


def exposed_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ endpoint reaches other hosts (tcp:// to a host other than loopback; ``*`` is every address)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return not is_loopback(host)


def exposed_metrics(config: Exposure) -> bool:
    """Whether the metrics are served to other hosts (allowed only with --insecure; main logs a warning)."""
    return bool(config.metrics_address) and not is_loopback(config.metrics_address.rpartition(":")[0])
