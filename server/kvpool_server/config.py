"""ServerConfig: every setting of kvpool-server, each declared once (settings.py: default, help, bounds, choices).

Each field is a flag ``--<name-with-dashes>`` and an environment variable ``KVPOOL_<NAME>``; a flag beats its
variable (``--pool-bytes`` <- ``KVPOOL_POOL_BYTES``), which beats the default. ``ServerConfig.validate()`` is pure:
it rejects values that cannot work together, with a message naming the setting, and reads nothing of the OS.
What the settings name on this host is checked apart, at start (``host_checks``: the files and CPUs they name, and
that the pool fits the host's memory and /dev/shm; ``service.build.build_service`` calls it).

The layout settings (``--num-layers`` ... ``--kv-layout``) are KVLayout's own fields with KVLayout's defaults
(``_layout_setting``); ``ServerConfig.layout`` builds the KVLayout from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.cli_flags import VLLM_SERVER_FLAGS, refuse_foreign_flags
from kvpool.layout import DTYPES, KV_LAYOUTS, KVLayout
from kvpool.tensor_parallel import check_split
from kvpool_server.core.eviction_policy import PREFIX_EVICTION_POLICIES
from kvpool_server.core.lrfu_eviction import DEFAULT_HALF_LIFE_TOKENS
from kvpool_server.log_setup import LOG_FORMATS, LOG_LEVELS, JsonLogFormatter
from kvpool_server.exposure import TransportError, check_transport
from kvpool_server.settings import (
    BYTES_FORMS,
    ENV_PREFIX,
    ConfigError,
    add_arguments,
    check_settings,
    parse_bytes,
    read_sources,
    setting,
)
from kvpool_server.config_file import CONFIG_ENV, read_config_file

__all__ = [
    "BACKENDS", "BYTES_FORMS", "DEFAULT_POOL_BYTES", "DTYPES", "ENV_PREFIX", "LOG_FORMATS", "LOG_LEVELS",
    "ConfigError", "JsonLogFormatter", "ServerConfig", "build_parser", "load_config",
    "parse_bytes", "server_version",
]

BACKENDS = ("auto", "gpu", "host")
DEFAULT_POOL_BYTES = 256 << 20
MiB = 1 << 20


def _layout_setting(name: str, help: str, **bounds: Any) -> Any:
    """A setting that is KVLayout's field ``name``: KVLayout's default, the server's help and bounds."""
    return setting(KVLayout.__dataclass_fields__[name].default, help, **bounds)


@dataclass
class ServerConfig:
    # Where to listen.
    address: str = setting("127.0.0.1:50051", "TCP HOST:PORT to listen on (port 0: any free port; empty: no TCP)")
    unix_socket: str | None = setting(None, "also (or only) listen on this unix socket path")
    port_file: str | None = setting(None, "write the bound TCP port to this file once listening (for port 0)")
    # Pool size: give at most one; num_blocks beats gpu_memory_fraction beats pool_bytes (pool_size_kwargs).
    pool_bytes: int | None = setting(
        None, f"pool size: bytes or 256MiB, 1GiB, 512MB (KB/MB/GB read as KiB/MiB/GiB); {DEFAULT_POOL_BYTES >> 20}MiB "
        "when no size is given. A host pool must fit the available memory and /dev/shm (checked at start)",
        min=1, size=True)
    num_blocks: int | None = setting(None, "pool size in blocks (instead of --pool-bytes)", min=1)
    gpu_memory_fraction: float | None = setting(
        None, "pool size as a fraction of free GPU memory (host backend: of free /dev/shm) (instead of --pool-bytes)",
        min=0, max=1, open_min=True)
    host_tier_bytes: int = setting(
        0, "the prefix cache's host tier: evicted cached blocks are kept in this much host memory (pinned with a "
        "GPU pool, allocated in the background; 0: none) and restored on a prompt's hit (docs/prefix-caching.md)",
        min=0, size=True)
    host_tier_writeback_blocks: int = setting(
        128, "with --host-tier-bytes: a background thread copies the pool's next-to-evict blocks into the host "
        "tier ahead of need, up to this many in flight (in chunks of 8); an eviction it did not reach drops the block from the tier "
        "rather than copy under the lock (0: no thread, offload on eviction, under the lock)",
        min=0)
    prefix_eviction: str = setting(
        "lru", "which cached blocks the prefix cache evicts first: lru (least recently used), or lrfu (least "
        "recently and frequently used: blocks reused by many requests outlive the tails of one-off prompts; it wins "
        "on long production conversations and loses on quick chat turns: docs/prefix-caching.md, Eviction policy)",
        choices=PREFIX_EVICTION_POLICIES)
    prefix_eviction_half_life_tokens: int = setting(
        DEFAULT_HALF_LIFE_TOKENS, "with --prefix-eviction lrfu: a use counts half once this many tokens' worth of "
        "blocks were released since (about twice the tokens served between a prefix's reuses; 0: the pool's own "
        "tokens, the choice that held on every workload replayed)", min=0)
    backend: str = setting("auto", "where the pool lives: auto (GPU if present, else host), gpu, host",
                           choices=BACKENDS)
    # Tensor parallelism (docs/device.md, "A pool for a tensor-parallel group"): N pools split by KV heads.
    tensor_parallel: int = setting(
        1, "ranks of a tensor-parallel group: N pools, one a rank, each holding num_kv_heads / N heads of every "
        "block (one head a rank, replicated, when N exceeds the heads) behind one allocator and one block-id space",
        min=1, max=64)
    tp_devices: str = setting(
        "", "the CUDA device of each rank with --tensor-parallel, e.g. 0,1,2,3 (empty: every shard on device 0)")
    # Layout (KVLayout's fields); the default is the seed's: 16 tokens a block, 128 float32 (512 bytes) a token.
    num_layers: int = _layout_setting("num_layers", "layers of KV per token", min=1)
    num_kv_heads: int = _layout_setting("num_kv_heads", "KV heads per layer", min=1)
    head_dim: int = _layout_setting("head_dim", "elements per head", min=1)
    block_size: int = _layout_setting("block_size", "tokens per block", min=1)
    dtype: str = _layout_setting("dtype", "KV element type", choices=DTYPES)
    kv_layout: str = _layout_setting(
        "kv_layout", "order of the pool's memory: block-major [blocks, layers, K/V, ...] (a block is one contiguous "
        "span) or layer-major [layers, K/V, blocks, ...] (each layer's K and V is one [blocks, block_size, heads, "
        "dim] tensor, what vLLM/FlashInfer/FlexAttention read); docs/device.md", choices=KV_LAYOUTS)
    # Limits.
    max_seq_len: int | None = setting(None, "longest sequence in tokens (default min(pool tokens, 32768))", min=1)
    max_num_seqs: int = setting(4096, "most live sequences", min=1)
    max_sessions: int = setting(4096, "most open sessions, server-wide; more are refused with RESOURCE_EXHAUSTED",
                                min=1)
    max_batch: int = setting(4096, "most sequences in one AppendToken / Free (more: INVALID_ARGUMENT)", min=1)
    max_message_bytes: int = setting(64 * MiB, "largest gRPC message received or sent", min=64 << 10, size=True)
    max_inflight_bytes: int = setting(
        256 * MiB, "bytes of large request bodies (WriteKV and the like) being parsed or copied at once, over all "
        "calls (a WriteKV's body is received only once admitted, charged at --max-message-bytes until its size is "
        "known); at least --max-message-bytes", min=(4 * MiB, "max_message_bytes"), size=True)
    max_tokens_per_call: int = setting(
        1 << 17, "most tokens one AppendToken (or AppendTokenStream message) may hand out (more: INVALID_ARGUMENT); "
        "bounds how long one call holds the pool", min=1)
    max_workers: int = setting(
        8, "copy threads: big WriteKV/ReadKV copies and CheckInvariants run there (every call itself runs on the "
        "server's event loop)", min=1)
    max_streams: int = setting(1024, "most open streams (AppendTokenStream); more are refused with RESOURCE_EXHAUSTED",
                               min=1)
    event_buffer_batches: int = setting(
        10_000, "KV event batches kept for SubscribeEvents subscribers resuming with from_seq; one further behind "
        "gets a snapshot instead (docs/prefix-caching.md)", min=1)
    event_buffer_bytes: int = setting(
        64 * MiB, "bytes the KV event log keeps for SubscribeEvents resumes (with --event-buffer-batches: whichever "
        "is reached first drops the oldest batches)", min=1 * MiB, size=True)
    max_event_subscribers: int = setting(
        64, "most open SubscribeEvents streams (they are not counted by --max-streams); more are refused with "
        "RESOURCE_EXHAUSTED", min=1)
    max_event_subscribers_per_tenant: int = setting(
        16, "with --auth-tokens, most open SubscribeEvents streams of one tenant, so that one tenant's idle "
        "subscribers cannot take every place; more are refused with RESOURCE_EXHAUSTED (without --auth-tokens every "
        "caller is one tenant and only --max-event-subscribers applies)", min=1)
    # KV events on vLLM's ZMQ wire, for llm-d's indexer and Dynamo's router (docs/scale-out.md; zmq_events/).
    kv_events_publish: str = setting(
        "", "publish KV events on vLLM's ZMQ wire: a PUB socket bound to this endpoint, e.g. tcp://127.0.0.1:5557 "
        "or ipc:///run/kvpool/events (empty: off; needs pyzmq and msgpack). A non-loopback endpoint needs --insecure")
    kv_events_connect: bool = setting(
        False, "connect the --kv-events-publish socket to the endpoint instead of binding it (a central indexer "
        "that binds, as llm-d's without pod discovery)", show_default=False)
    kv_events_replay: str = setting(
        "", "also serve vLLM's replay protocol on a ROUTER socket bound to this endpoint, e.g. tcp://127.0.0.1:5558")
    kv_events_pod: str = setting(
        "", "the pod in the topic kv@<pod>@<model> (default: this host's name); several, comma-separated: each "
        "message goes under each (every frontend sharing this pool, as the router knows it, e.g. IP:PORT)")
    kv_events_model: str = setting(
        "", "the model name KV events are published under (the topic's <model>; what the router scores requests "
        "for); with --auth-tokens, each tenant's name is given apart (below)")
    kv_events_tenant_models: str = setting(
        "", "tenant=model,...: each tenant's blocks under a model name of its own (distinct names); a tenant not "
        "listed is not published. Public-prefix blocks go under every listed name")
    kv_events_socket_per_model: bool = setting(
        False, "a PUB (and replay) socket per model name, each with consecutive sequence numbers: the i-th name "
        "(the model, then the tenants' in order) on the endpoint's port + i (ipc: PATH-i); default: one socket "
        "carries every topic", show_default=False)
    kv_events_layout: str = setting(
        "array", "msgpack layout of the batches: array (msgspec array_like, what llm-d and Dynamo decode) or map "
        "(the newest vLLM's)", choices=("array", "map"))
    kv_events_queue_bytes: int = setting(
        64 * MiB, "KV event batches waiting for the publisher thread (estimated bytes); past it they are dropped "
        "and the cache is restated (AllBlocksCleared, then every cached block)", min=1 * MiB, size=True)
    kv_events_replay_batches: int = setting(10_000, "messages kept for replay requests", min=1)
    kv_events_replay_bytes: int = setting(
        64 * MiB, "payload bytes kept for replay (with the bound in messages: whichever is reached first drops the "
        "oldest)", min=1 * MiB, size=True)
    kv_events_replay_peer_bytes: int = setting(
        1 * MiB, "replay bytes the server holds for one replay peer (sent, not yet taken by its connection); past it "
        "the peer's replay waits until it reads (a larger message is sent alone)", min=64 << 10, size=True)
    kv_events_replay_queued_bytes: int = setting(
        64 * MiB, "replay bytes the server holds for all replay peers together (peers that never read keep their "
        "share until they disconnect; other replays wait meanwhile)", min=1 * MiB, size=True)
    stream_idle_timeout_s: float = setting(
        300.0, "end a stream that read no message and had no reply taken for this long (UNAVAILABLE; 0: never)", min=0)
    keepalive_time_s: float = setting(30.0, "ping every client connection this often (finds vanished peers)", min=1)
    keepalive_timeout_s: float = setting(
        10.0, "a connection whose ping is not answered within this is dead; its calls are cancelled", min=1)
    # Sessions: the lease a client gets unless it asks for another, and the longest it may ask for (milliseconds).
    session_ttl_ms: int = setting(
        10_000, "a session's lease when its client asks for none: it ends (and its sequences are freed) this long "
        "after its last heartbeat", min=100, max="max_session_ttl_ms")
    max_session_ttl_ms: int = setting(300_000, "the longest lease a client may ask for", min=100)
    # The shared-memory fast path (docs/fast-path.md): Register/Append/Fork/Free as records for local sessions.
    no_fast_path: bool = setting(
        False, "offer no shared-memory channel to local sessions (OpenFastPath answers FAILED_PRECONDITION): gRPC "
        "only", show_default=False)
    fast_path_area_bytes: int = setting(
        1 * MiB, "each fast-path channel's request area and reply area (a bigger record goes over gRPC)",
        min=64 << 10, max=64 * MiB, size=True)
    fast_path_max_channels: int = setting(
        256, "most open fast-path channels (each reserves its two areas of /dev/shm when opened)",
        min=1)
    shutdown_grace_s: float = setting(10.0, "seconds in-flight calls get to finish after SIGTERM/SIGINT", min=0)
    shutdown_drain_s: float = setting(
        2.0, "at shutdown, at most this many seconds of refusing new calls (UNAVAILABLE) before the listener closes; "
        "ends early once clients have gone quiet", min=0)
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING, ERROR, CRITICAL (any case)", choices=LOG_LEVELS,
                             normalize=str.upper)
    log_format: str = setting("text", "text, or json: one JSON object a line (for log shippers)", choices=LOG_FORMATS)
    metrics_address: str = setting(
        "", "serve Prometheus metrics on HOST:PORT at /metrics, e.g. 127.0.0.1:9400 (empty: off; docs/metrics.md). "
        "Metrics have no authentication: a non-loopback HOST needs --insecure")
    cpu_affinity: str = setting(
        "", "pin every server thread to these CPUs, e.g. 0 or 0-3,8 (empty: no pinning). The server runs Python "
        "under one GIL, so one core is all it uses; pinning it keeps its threads' caches warm (docs/api.md)")
    # Security (docs/security.md; transport.py): tokens -> tenants and roles, TLS, the unix socket's group.
    auth_tokens: str | None = setting(
        None, "tokens file (TOML: sha256 of each token -> tenant, role; tenants' quotas); every call then needs "
        "'authorization: Bearer <token>'; re-read on SIGHUP (docs/security.md)")
    tls_cert: str | None = setting(None, "PEM certificate (chain) for TLS on the TCP address")
    tls_key: str | None = setting(None, "PEM private key of --tls-cert")
    tls_client_ca: str | None = setting(None, "PEM CA: mutual TLS, clients must present a certificate it signed")
    unix_socket_group: str = setting("", "the unix socket is 0600; with a group it is 0660 and that group's")
    insecure: bool = setting(
        False, "allow a non-loopback --address without --auth-tokens or --tls-cert, and a non-loopback "
        "--metrics-address (logged as a warning)", show_default=False)

    @property
    def layout(self) -> KVLayout:
        return KVLayout(**{f.name: getattr(self, f.name) for f in dataclasses.fields(KVLayout)})

    def cpu_set(self) -> frozenset[int] | None:
        """``cpu_affinity`` as a set of CPU numbers (None: no pinning). Pure: whether this process may use them is
        host_checks.check_environment's question."""
        if not self.cpu_affinity.strip():
            return None
        cpus: set[int] = set()
        for part in self.cpu_affinity.split(","):
            first, dash, last = part.strip().partition("-")
            if not first.isdigit() or (dash and not (last.isdigit() and int(last) >= int(first))):
                raise ConfigError(f"--cpu-affinity must be a CPU list such as 0 or 0-3,8, got {self.cpu_affinity!r}")
            cpus.update(range(int(first), int(last if dash else first) + 1))
        return frozenset(cpus)

    def kv_events_tenant_model_map(self) -> dict[str, str]:
        """``kv_events_tenant_models`` as tenant -> model name; raises ConfigError on a malformed list."""
        models: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in self.kv_events_tenant_models.split(","))):
            tenant, eq, model = part.partition("=")
            if not eq or not tenant.strip() or not model.strip() or tenant.strip() in models:
                raise ConfigError("--kv-events-tenant-models must be tenant=model,... (each tenant once), got "
                                  f"{self.kv_events_tenant_models!r}")
            models[tenant.strip()] = model.strip()
        return models

    def check_kv_events(self) -> None:
        """Raise ConfigError for KV event settings that cannot work (pure)."""
        models = self.kv_events_tenant_model_map()
        if not self.kv_events_publish:
            if self.kv_events_replay:
                raise ConfigError("--kv-events-replay needs --kv-events-publish")
            return
        for flag, endpoint in (("--kv-events-publish", self.kv_events_publish),
                               ("--kv-events-replay", self.kv_events_replay)):
            if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"{flag} must be tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
        if self.kv_events_connect and self.kv_events_socket_per_model:
            raise ConfigError("--kv-events-socket-per-model binds a socket per model name (port + i); with "
                              "--kv-events-connect every model name goes to the one endpoint connected to")
        names = list(models.values()) + ([self.kv_events_model] if self.kv_events_model else [])
        if not names:
            raise ConfigError("--kv-events-publish needs a model name: --kv-events-model (and, with --auth-tokens, "
                              "--kv-events-tenant-models)")
        if len(set(names)) != len(names):
            raise ConfigError("each tenant needs a model name of its own (--kv-events-model, "
                              f"--kv-events-tenant-models): {names} repeats one; a router would score one tenant's "
                              "blocks for another")
        for what in [*self.kv_events_pod.split(","), *names]:
            if "@" in what:
                raise ConfigError(f"{what!r}: no '@' in --kv-events-pod or a model name (the topic is "
                                  "kv@<pod>@<model>)")

    def tp_device_list(self) -> list[int] | None:
        """``tp_devices`` as one CUDA device id per rank (None: not given)."""
        if not self.tp_devices.strip():
            return None
        parts = [p.strip() for p in self.tp_devices.split(",")]
        if not all(p.isdigit() for p in parts):
            raise ConfigError(f"--tp-devices must be CUDA device ids such as 0,1,2,3, got {self.tp_devices!r}")
        devices = [int(p) for p in parts]
        if len(devices) != self.tensor_parallel:
            raise ConfigError(f"--tp-devices names {len(devices)} devices for --tensor-parallel "
                              f"{self.tensor_parallel}: give one a rank")
        return devices

    def pool_size_kwargs(self) -> dict[str, int | float]:
        """The one sizing argument for ``create_pool``."""
        if self.num_blocks is not None:
            return {"num_blocks": self.num_blocks}
        if self.gpu_memory_fraction is not None:
            return {"gpu_memory_fraction": self.gpu_memory_fraction}
        return {"pool_bytes": self.pool_bytes if self.pool_bytes is not None else DEFAULT_POOL_BYTES}

    def validate(self) -> ServerConfig:
        """Raise ConfigError, naming the setting, for values that cannot work; reads no file and no OS state and
        changes nothing. Returns self."""
        check_settings(self)  # every setting's choices and bounds
        if not self.address and not self.unix_socket:
            raise ConfigError("nothing to listen on: give --address and/or --unix-socket")
        if self.address and ":" not in self.address:
            raise ConfigError(f"--address must be HOST:PORT, got {self.address!r}")
        if self.address:
            port = self.address.rsplit(":", 1)[1]
            if not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"--address port must be 0..65535, got {port!r}")
        if self.port_file and not self.address:
            raise ConfigError("--port-file needs a TCP --address")
        if self.metrics_address:
            host, colon, port = self.metrics_address.rpartition(":")
            if not colon or not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"--metrics-address must be HOST:PORT (port 0..65535), got {self.metrics_address!r}")
        sizings = [n for n, v in (("--pool-bytes", self.pool_bytes), ("--num-blocks", self.num_blocks),
                                  ("--gpu-memory-fraction", self.gpu_memory_fraction)) if v is not None]
        if len(sizings) > 1:
            raise ConfigError(f"give one of {', '.join(sizings)}, not several")
        if self.layout.token_bytes > self.max_message_bytes // 2:
            raise ConfigError(f"one token's KV ({self.layout.token_bytes} bytes) does not fit --max-message-bytes")
        if 0 < self.host_tier_bytes < self.layout.block_bytes:
            raise ConfigError(f"--host-tier-bytes {self.host_tier_bytes} is less than one block "
                              f"({self.layout.block_bytes} bytes): give 0 (no host tier) or at least a block")
        self.cpu_set()  # raises ConfigError on a bad list
        self.check_kv_events()
        try:
            check_split(self.num_kv_heads, self.tensor_parallel)
        except ValueError as exc:
            raise ConfigError(f"--tensor-parallel {self.tensor_parallel}: {exc}") from None
        self.tp_device_list()  # raises ConfigError on a bad list
        try:
            check_transport(self)
        except TransportError as exc:
            raise ConfigError(str(exc)) from None
        return self

    def metrics_host_port(self) -> tuple[str, int] | None:
        """``metrics_address`` split for prometheus_client (None: no metrics server)."""
        if not self.metrics_address:
            return None
        host, _, port = self.metrics_address.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)


def server_version() -> str:
    """The installed kvpool distribution's version ("unknown" when run from a bare source tree)."""
    try:
        return importlib.metadata.version("kvpool")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool-server",
        description="kvpool: KV-cache block pool of one GPU (or host memory) as a gRPC service. "
        f"Every flag can also be set by an environment variable {ENV_PREFIX}<FLAG> (e.g. KVPOOL_POOL_BYTES).",
        allow_abbrev=False,  # --port must not mean --port-file (kvpool.cli_flags)
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {server_version()}")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help=f"read settings from this TOML file (keys: the settings' names, e.g. pool_bytes = "
                        f"\"1GiB\"); flags and {ENV_PREFIX}* variables override it (env {CONFIG_ENV})")
    parser.add_argument("--print-config", action="store_true",
                        help="print the merged settings as TOML, each with where it came from, and exit")
    add_arguments(parser, ServerConfig)
    refuse_foreign_flags(parser, "kvpool-server", VLLM_SERVER_FLAGS)
    return parser


# KVPOOL_* variables of the other tools, which kvpool-server does not warn about (a name ending in _ is a prefix):
# the clients' (kvpool_client/credentials.py, loadgen/auth.py), compose's and the scripts'.
OTHER_TOOLS_VARIABLES = (
    "KVPOOL_TARGET", "KVPOOL_TOKEN", "KVPOOL_TOKEN_FILE", "KVPOOL_ADMIN_TOKEN", "KVPOOL_ADMIN_TOKEN_FILE",
    "KVPOOL_CLIENT_", "KVPOOL_LOADGEN_", "KVPOOL_HEALTH_", "KVPOOL_PROMETHEUS_", "KVPOOL_GRAFANA_", "KVPOOL_IMAGE_",
    "KVPOOL_PORT", "KVPOOL_BENCH_", "KVPOOL_TEST_", "KVPOOL_DEMO_", "KVPOOL_LLAMA_", "KVPOOL_GPU", CONFIG_ENV,
    "KVPOOL_ENGINE_", "KVPOOL_VLLM_",  # the decode engine's and the vLLM connector's (client side)
)


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Flags (``argv``) over ``KVPOOL_*`` variables (``environ``, default os.environ) over the ``--config`` file
    over defaults, validated. Pure but for reading that file: what the settings name on this host (files, CPUs,
    memory) is ``host_checks``' to check, at start."""
    return load_config_and_sources(argv, environ)[0]


def load_config_and_sources(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                            ) -> tuple[ServerConfig, dict[str, str]]:
    """``load_config``'s config, and where each given setting came from (``--print-config``)."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    path = args.config or environ.get(CONFIG_ENV) or None
    file_values = read_config_file(path, ServerConfig) if path else None
    values, sources = read_sources(ServerConfig, args, environ, file_values, path or "")
    return ServerConfig(**values).validate(), sources


