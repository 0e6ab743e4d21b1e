"""kvpool-server: serve() starts the server that grpc_server.build_server() built and runs it until SIGTERM/SIGINT.

Shutdown (``shutdown()``), in order: health goes NOT_SERVING, new calls are refused with UNAVAILABLE while calls
already running go on, the server stops listening and in-flight calls get ``shutdown_grace_s`` to finish, then
the pool is closed (shared memory unlinked / GPU memory freed) and the process exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool_server.config import OTHER_TOOLS_VARIABLES, ConfigError, ServerConfig, load_config_and_sources
from kvpool_server.config_file import render
from kvpool_server.core_log import CoreLogCapture
from kvpool_server.host_checks import check_environment
from kvpool_server.log_setup import configure_logging, fatal_line, requested_log_format
from kvpool_server.grpc_api.server import ServerHandle, build_server
from kvpool_server.service.build import StartupError
from kvpool_server import gc_policy
from kvpool_server.process import pin_threads
from kvpool_server.exposure import exposed_endpoint, exposed_metrics, is_loopback
from kvpool_server.settings import unknown_variables
from kvpool_server.zmq_events import start_publisher

if TYPE_CHECKING:
    from kvpool_server.device.protocol import Pool

logger = logging.getLogger("kvpool_server")
DRAIN_QUIET_S = 0.2  # shutdown stops draining once no call has been refused for this long


def tensor_parallel_words(pool: Pool) -> str:
    """For the start line: how a tensor-parallel pool is split (nothing for one pool)."""
    if pool.tensor_parallel == 1:
        return ""
    shards = pool.rank_shards()
    devices = sorted({s.attach.cuda_device for s in shards if s.attach.cuda_device is not None})
    where = f" on CUDA devices {','.join(map(str, devices))}" if devices else ""
    return (f" split over {pool.tensor_parallel} tensor-parallel shards ({len(shards[0].heads)} of "
            f"{pool.layout.num_kv_heads} KV heads each){where}")


def serve(config: ServerConfig) -> int:
    """Start, run until SIGTERM or SIGINT, then shut down gracefully. Returns the exit code."""
    cpus = config.cpu_set()
    if cpus is not None:
        pin_threads(cpus)  # before build_server: the threads it starts inherit the mask
    handle = build_server(config)  # refuses a host pool larger than the memory or /dev/shm (not SIGBUS later)
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # SIGHUP: re-read --auth-tokens (revoked tokens are refused from the next call on); without it, ignored. In a
    # thread: the main thread may hold the core's lock (shutdown), and nothing raised there may end the server.
    signal.signal(signal.SIGHUP, lambda signum, frame: threading.Thread(
        target=handle.service.reload_tokens, name="kvpool-sighup", daemon=True).start())
    if config.insecure and config.address and not is_loopback(config.address.rsplit(":", 1)[0]):
        logger.warning("--insecure: %s takes calls from other hosts%s", config.address,
                       "" if config.auth_tokens or config.tls_cert else " with no authentication and no TLS")
    if config.insecure and any(map(exposed_endpoint, (config.kv_events_publish, config.kv_events_replay))):
        logger.warning("--insecure: KV events on %s (every published block's token ids) reach other hosts",
                       " and ".join(filter(None, (config.kv_events_publish, config.kv_events_replay))))
    if exposed_metrics(config):  # only with --insecure (validate)
        logger.warning("--insecure: metrics on %s (tenant names and usage) are readable by other hosts",
                       config.metrics_address)
    try:
        publisher = start_publisher(config, handle.service.guard)  # --kv-events-publish (None without it)
    except BaseException:
        handle.stop()
        handle.pool.close()
        raise
    if publisher is not None and handle.metrics is not None:
        from kvpool_server.zmq_events.metrics import ZmqEventsCollector

        handle.metrics.registry.register(ZmqEventsCollector(publisher))
    try:
        handle.start()
    except BaseException:
        handle.stop()
        if publisher is not None:
            publisher.stop()
        handle.pool.close()
        raise
    if config.port_file and handle.port is not None:
        _write_atomically(config.port_file, f"{handle.port}\n")
    num_frozen = gc_policy.apply()  # the collector's policy, after start-up (the core's records lists frozen)
    where = []
    if config.address:
        where.append(f"{config.address.rsplit(':', 1)[0]}:{handle.port}")
    if config.unix_socket:
        where.append(f"unix:{config.unix_socket}")
    if handle.metrics_http is not None:
        where.append(f"metrics {handle.metrics_http.url}")
    if publisher is not None:
        where.append(f"KV events {publisher.endpoints()}")
    logger.info(
        "kvpool-server %d listening on %s: %s pool%s, %d blocks of %d tokens (%d bytes each); %d start-up objects "
        "frozen out of garbage collection; CPUs %s; %s; %s",
        os.getpid(), ", ".join(where), handle.pool.backend, tensor_parallel_words(handle.pool),
        handle.pool.num_blocks, config.block_size,
        config.layout.block_bytes, num_frozen, ",".join(map(str, sorted(cpus))) if cpus else "any",
        handle.service.auth.summary() if handle.service.auth is not None else "auth off",
        tls_summary(config),
    )
    # Wake every second: a signal delivered to another thread sets Python's flag but does not interrupt this wait,
    # and the handler only runs once the main thread runs Python code again (a pinned server sometimes ignored
    # SIGTERM while this waited an hour at a time).
    while not stop.wait(1.0):
        pass
    logger.info("signal %d: shutting down (grace %.1fs)", received[0], config.shutdown_grace_s)
    shutdown(handle, config.shutdown_grace_s, config.shutdown_drain_s)
    if publisher is not None:
        publisher.stop()  # after the last call: its events are sent
    logger.info("kvpool-server %d stopped", os.getpid())
    return 0


def tls_summary(config: ServerConfig) -> str:
    """TLS on the start line: off, on, or mutual (a client CA)."""
    if not config.tls_cert:
        return "TLS off"
    return "TLS on, mutual (client CA " + config.tls_client_ca + ")" if config.tls_client_ca else "TLS on, no client CA"


def shutdown(handle: ServerHandle, grace_s: float, drain_s: float = 0.0) -> None:
    """Stop serving without cutting off a call:

    1. the call scope refuses new calls with UNAVAILABLE and health goes NOT_SERVING (calls already inside go on;
       an AppendTokenStream finishes its message in progress, then ends with UNAVAILABLE; one waiting for its
       client's next message ends with UNAVAILABLE at once);
    2. that lasts until no call has been refused for DRAIN_QUIET_S, or ``drain_s`` at most: it empties gRPC's
       queue of calls received but not yet started, which ``server.stop`` would end with CANCELLED, not
       UNAVAILABLE (grpc/grpc#41785);
    3. the calls still inside get up to ``grace_s`` to finish;
    4. ``server.stop(0)``: the listener closes and what is left -- health Watch streams, AppendTokenStreams idle
       between messages, calls past the grace -- is cancelled (waiting on them would make every shutdown last
       ``grace_s``); every stream's end-of-stream hook runs; the event loop, the background tasks and the copy
       threads stop;
    5. the pool is released (under the lock; a copy cut off at the grace deadline finishes its chunk first).
    """
    handle.begin_drain()
    handle.admission.wait_quiet(DRAIN_QUIET_S, drain_s)
    num_left = handle.admission.wait_idle(grace_s)
    if num_left:
        logger.warning("%d calls still running after the %.1fs grace; cancelling them", num_left, grace_s)
    handle.stop()
    with handle.service.guard.lock:
        handle.pool.close()


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".port-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> None:
    """Fatal start-up errors go to stderr in the --log-format asked for (a JSON line with json), exit 2 for a
    setting, 1 for a start that failed; unknown ``KVPOOL_*`` variables are warned about (a misspelt one would
    otherwise be silently ignored)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        config, sources = load_config_and_sources(args)
        if "--print-config" in args:  # the merged settings, checked as a start checks them, then no start
            print(render(config, sources), end="")
            sys.exit(0)
        check_environment(config)  # the files and CPUs it names (before serve pins threads to them)
    except ConfigError as exc:
        print(fatal_line(str(exc), requested_log_format(args, os.environ)), file=sys.stderr)
        sys.exit(2)
    core_log = CoreLogCapture()  # gRPC C-core's lines through the logging configured next (core_log.py)
    core_log.start()
    configure_logging(config.log_level, config.log_format)
    for warning in unknown_variables(ServerConfig, os.environ, OTHER_TOOLS_VARIABLES):
        logger.warning("%s", warning)
    try:
        code = serve(config)
    except StartupError as exc:
        core_log.stop()  # the core's own line about it first, if kvpool does not say it better
        print(fatal_line(str(exc), config.log_format), file=sys.stderr)
        sys.exit(1)
    core_log.stop()
    sys.exit(code)


if __name__ == "__main__":
    main()
