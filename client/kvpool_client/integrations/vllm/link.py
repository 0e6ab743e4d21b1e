"""KVPoolLink: the connector's connection to kvpool -- open, checked, or being retried in the background.

A kvpool that is not there, or that dies, is a cache miss and never an error of vLLM: the first failure logs one
warning, ``client`` becomes None (every lookup misses, nothing is stored) and a daemon thread tries to connect
again every ``retry_s``; a connection found logs once more. Each connection has a new ``generation``: state
that belongs to an older one (sequences of a session the server has since ended) is dropped, not used.

What does stop vLLM is a kvpool that cannot serve it as configured (ConnectorConfigError): a pool whose layout
cannot hold the model's KV, or a tenant that may not map the pool. That is a configuration error, raised from the
first connection made at start-up (and logged, not retried, when it is first seen on a later one).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable

from kvpool_client import KVPoolClient, KVPoolClientError, RetryPolicy
from kvpool_client.types import PoolDescription

from .settings import ConnectorConfigError, ConnectorSettings, ModelLayout

logger = logging.getLogger("kvpool_client.integrations.vllm")

# Failures that mean "kvpool is not usable now": everything of the client library's, and the OS's (a socket).
LINK_ERRORS: tuple[type[BaseException], ...] = (KVPoolClientError, OSError, TimeoutError)


def pool_id(description: PoolDescription) -> str:
    """Names one pool of one server process: its pid and its mapping (segment name, or the IPC handle's digest)."""
    where = description.shm_name or hashlib.sha256(description.cuda_ipc_handle).hexdigest()[:16]
    return f"{description.server_pid}:{description.backend}:{where}"


class KVPoolLink:
    """The scheduler side's client of kvpool (``client``: None while kvpool is unreachable)."""

    def __init__(self, settings: ConnectorSettings, layout: ModelLayout, *, session: bool = True,
                 client_name: str = "vllm") -> None:
        self.settings = settings
        self.layout = layout
        self._session = session
        self._client_name = client_name
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.client: KVPoolClient | None = None
        self.description: PoolDescription | None = None
        self.pool_id = ""
        self.generation = 0
        self._token = settings.token()  # read once, at start: a bad token file stops vLLM with its message
        try:
            self._connect()
        except ConnectorConfigError:
            raise
        except LINK_ERRORS as error:
            self._went_down(f"kvpool at {settings.target} is not reachable ({type(error).__name__}: {error})")

    def _connect(self) -> None:
        client = KVPoolClient(self.settings.target, timeout=self.settings.timeout_s,
                              retry=RetryPolicy(max_attempts=1), token=self._token, session=self._session,
                              client_name=self._client_name)
        try:
            description = client.describe_pool()
            self.layout.check_pool(description.layout, self.settings.target)
            if description.tensor_parallel > 1:
                raise ConnectorConfigError(f"KVPoolConnector: the pool at {self.settings.target} is split over "
                                           f"{description.tensor_parallel} ranks; vLLM runs one")
            if not (description.shm_name or description.cuda_ipc_handle):
                raise ConnectorConfigError(
                    f"KVPoolConnector: kvpool at {self.settings.target} does not let this tenant map its pool "
                    "(may_attach = false in the tokens file): vLLM's workers copy blocks through the mapping")
        except BaseException:
            _close(client)
            raise
        with self._lock:
            self.client, self.description = client, description
            self.pool_id = pool_id(description)
            self.generation += 1

    def down(self, why: str) -> None:
        """A call failed as kvpool being gone: drop the client and retry in the background."""
        with self._lock:
            client, self.client = self.client, None
        if client is not None:
            _close(client)
            self._went_down(why)

    def _went_down(self, why: str) -> None:
        logger.warning("KVPoolConnector: %s; vLLM serves without kvpool (every lookup a miss) and tries again "
                       "every %g s", why, self.settings.retry_s)
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._retry, name="kvpool-connector-retry", daemon=True)
            self._thread.start()

    def _retry(self) -> None:
        while not self._stop.wait(self.settings.retry_s):
            try:
                self._connect()
            except ConnectorConfigError as error:
                logger.error("%s", error)
                return
            except LINK_ERRORS:
                continue
            logger.warning("KVPoolConnector: connected to kvpool at %s (pool %s)", self.settings.target,
                           self.pool_id)
            return

    def call(self, what: str, fn: Callable[[KVPoolClient], object], *, per_request: tuple[type[BaseException], ...]
             = ()) -> object | None:
        """``fn(client)``, or None when there is no client or the call fails. An error in ``per_request`` (this
        request's own: a prompt too long, a full pool) is a miss for it alone; any other takes the link down."""
        client = self.client
        if client is None:
            return None
        try:
            return fn(client)
        except per_request:
            return None
        except LINK_ERRORS as error:
            self.down(f"{what} failed ({type(error).__name__}: {error})")
            return None

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            client, self.client = self.client, None
        if client is not None:
            _close(client)


def _close(client: KVPoolClient) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001  (a dead server: closing is best-effort, its session ends with it)
        logger.debug("closing the kvpool client failed", exc_info=True)
