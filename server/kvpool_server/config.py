"""ServerConfig: every setting of kvpool-server, from flags, KVPOOL_* environment variables and defaults.

Precedence: a command-line flag beats its environment variable (``--pool-bytes`` <- ``KVPOOL_POOL_BYTES``), which
beats the default. ``ServerConfig.validate()`` rejects a configuration that cannot work, with a message naming the
setting, before anything is bound or allocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpool.layout import KV_LAYOUTS, KVLayout
from kvpool_server.grpc_api.listen import TransportError, check_transport

ENV_PREFIX = "KVPOOL_"
BACKENDS = ("auto", "gpu", "host")
DTYPES = ("float32", "float16", "bfloat16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_POOL_BYTES = 256 << 20
LOG_FORMATS = ("text", "json")
# Binary multiples. KB/MB/GB are read as KiB/MiB/GiB, as Docker reads them: a pool is sized in powers of two.
_SUFFIXES = {
    "b": 1,
    **{s: 1 << 10 for s in ("k", "kb", "kib")},
    **{s: 1 << 20 for s in ("m", "mb", "mib")},
    **{s: 1 << 30 for s in ("g", "gb", "gib")},
    **{s: 1 << 40 for s in ("t", "tb", "tib")},
}
BYTES_FORMS = "bytes (268435456) or a number with KiB/MiB/GiB (256MiB, 1.5GiB; KB/MB/GB and k/m/g mean the same)"


class ConfigError(ValueError):
    """A setting that cannot work; the message names it."""


def parse_bytes(text: str | int) -> int:
    """``"268435456"``, ``"256MiB"``, ``"256MB"``, ``"256m"``, ``"1GiB"``, ``"1.5 GiB"`` -> bytes.

    Raises ConfigError saying which forms are accepted.
    """
    if isinstance(text, int):
        return text
    value = text.strip().lower().replace("_", "")
    number, multiple = value, 1
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if value.endswith(suffix):
            number, multiple = value[: -len(suffix)].strip(), _SUFFIXES[suffix]
            break
    try:
        amount = float(number) if "." in number or "e" in number else int(number)
    except ValueError:
        raise ConfigError(f"{text!r} is not a size: give {BYTES_FORMS}") from None
    if amount != amount or amount in (float("inf"), float("-inf")):
        raise ConfigError(f"{text!r} is not a size: give {BYTES_FORMS}")
    return int(amount * multiple)


def _bytes_arg(text: str) -> int:
    """argparse ``type=`` for byte sizes: its message, not argparse's 'invalid parse_bytes value'."""
    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def server_version() -> str:
    """The installed kvpool-server distribution's version ("unknown" when run from a bare source tree)."""
    try:
        return importlib.metadata.version("kvpool-server")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def pool_error_message(backend: str, exc: BaseException) -> str:
    """What to tell the user when ``create_pool`` failed: the error, and what to do about it (``build_servicer``
    raises ``StartupError`` with it)."""
    text = f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc)
    cuda_words = ("cuda", "cupy", "nvrtc", "libcu", "driver")
    if backend == "gpu" and (isinstance(exc, ImportError) or any(w in text.lower() for w in cuda_words)):
        return (f"cannot create the gpu pool: no CUDA GPU/driver found ({text}): use --backend host or auto "
                "(KVPOOL_BACKEND=host), or install CuPy for this CUDA (`make setup GPU=1`, requirements/gpu.txt)")
    if "/dev/shm" in text or isinstance(exc, OSError) and backend != "gpu":
        return (f"cannot create the {backend} pool: {text} (host pools live in /dev/shm: is it large enough? "
                "use a smaller --pool-bytes, or give the container more --shm-size)")
    return f"cannot create the {backend} pool: {text}"


@dataclass
class ServerConfig:
    # Where to listen: a TCP address (port 0 picks one; "" for none) and/or a unix socket path.
    address: str = "127.0.0.1:50051"
    unix_socket: str | None = None
    port_file: str | None = None  # the bound TCP port is written here (atomically) once the server listens
    # Pool size: num_blocks beats gpu_memory_fraction beats pool_bytes (256 MiB when none is given).
    pool_bytes: int | None = None
    num_blocks: int | None = None
    gpu_memory_fraction: float | None = None
    backend: str = "auto"
    # Layout; the default is the seed's: 16 tokens a block, 128 float32 (512 bytes) a token.
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"
    # Order of the pool's memory: block-major (a block is one span) or layer-major (a layer's K or V is one tensor).
    kv_layout: str = "block-major"
    # Limits.
    max_seq_len: int | None = None  # None: min(num_blocks * block_size, 32768), the core's default
    max_num_seqs: int = 4096
    max_batch: int = 4096  # sequences per AppendToken / Free
    max_message_bytes: int = 64 << 20
    max_tokens_per_call: int = 1 << 17  # tokens one AppendToken (or stream message) may hand out
    max_workers: int = 8  # copy threads: big WriteKV/ReadKV copies, CheckInvariants (calls run on the event loop)
    max_streams: int = 1024  # open streams (AppendTokenStream, ...); more are refused with RESOURCE_EXHAUSTED
    event_buffer_batches: int = 10_000  # SubscribeEvents batches kept to resume from (further behind: a snapshot)
    max_event_subscribers: int = 64  # open SubscribeEvents streams; more are refused with RESOURCE_EXHAUSTED
    stream_idle_timeout_s: float = 300.0  # a stream with no message read or reply taken this long is ended (0: never)
    keepalive_time_s: float = 30.0  # ping every connection this often
    keepalive_timeout_s: float = 10.0  # a connection whose ping is unanswered this long is dead: its calls cancelled
    # Sessions: the lease a client gets unless it asks for another, and the longest it may ask for (milliseconds).
    session_ttl_ms: int = 10_000
    max_session_ttl_ms: int = 300_000
    shutdown_grace_s: float = 10.0
    shutdown_drain_s: float = 2.0
    log_level: str = "INFO"
    log_format: str = "text"  # "json": one JSON object a line (configure_logging)
    # Prometheus metrics over HTTP on HOST:PORT ("" for none); see docs/metrics.md.
    metrics_address: str = ""
    # CPUs every server thread runs on, e.g. "0" or "0-3,8"; "" leaves the scheduler free. See cpu_set().
    cpu_affinity: str = ""
    # Security (docs/security.md; transport.py): tokens -> tenants and roles, TLS, the unix socket's group.
    auth_tokens: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    unix_socket_group: str = ""
    insecure: bool = False

    def cpu_set(self) -> frozenset[int] | None:
        """``cpu_affinity`` as a set of CPU numbers (None: no pinning); each must be one this process may use."""
        if not self.cpu_affinity.strip():
            return None
        cpus: set[int] = set()
        for part in self.cpu_affinity.split(","):
            first, dash, last = part.strip().partition("-")
            if not first.isdigit() or (dash and not (last.isdigit() and int(last) >= int(first))):
                raise ConfigError(f"--cpu-affinity must be a CPU list such as 0 or 0-3,8, got {self.cpu_affinity!r}")
            cpus.update(range(int(first), int(last if dash else first) + 1))
        allowed = os.sched_getaffinity(0)
        if not cpus <= allowed:
            raise ConfigError(
                f"--cpu-affinity names CPUs {sorted(cpus - allowed)} this process may not use "
                f"(allowed: {sorted(allowed)})"
            )
        return frozenset(cpus)

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype,
                        self.kv_layout)

    def pool_size_kwargs(self) -> dict[str, int | float]:
        """The one sizing argument for ``create_pool``."""
        if self.num_blocks is not None:
            return {"num_blocks": self.num_blocks}
        if self.gpu_memory_fraction is not None:
            return {"gpu_memory_fraction": self.gpu_memory_fraction}
        return {"pool_bytes": self.pool_bytes if self.pool_bytes is not None else DEFAULT_POOL_BYTES}

    def validate(self) -> ServerConfig:
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
        sizings = [n for n, v in (("--pool-bytes", self.pool_bytes), ("--num-blocks", self.num_blocks),
                                  ("--gpu-memory-fraction", self.gpu_memory_fraction)) if v is not None]
        if len(sizings) > 1:
            raise ConfigError(f"give one of {', '.join(sizings)}, not several")
        if self.pool_bytes is not None and self.pool_bytes < 1:
            raise ConfigError(f"--pool-bytes must be >= 1, got {self.pool_bytes}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"--num-blocks must be >= 1, got {self.num_blocks}")
        if self.gpu_memory_fraction is not None and not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError(f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "max_num_seqs", "max_batch",
                     "max_workers", "max_streams", "max_tokens_per_call", "event_buffer_batches",
                     "max_event_subscribers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 100 <= self.session_ttl_ms <= self.max_session_ttl_ms:
            raise ConfigError(
                f"--session-ttl-ms must be in [100, --max-session-ttl-ms={self.max_session_ttl_ms}], "
                f"got {self.session_ttl_ms}"
            )
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ConfigError(f"--max-seq-len must be >= 1, got {self.max_seq_len}")
        if self.max_message_bytes < 64 << 10:
            raise ConfigError(f"--max-message-bytes must be >= 65536, got {self.max_message_bytes}")
        if self.layout.token_bytes > self.max_message_bytes // 2:
            raise ConfigError(f"one token's KV ({self.layout.token_bytes} bytes) does not fit --max-message-bytes")
        for name in ("keepalive_time_s", "keepalive_timeout_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("shutdown_grace_s", "shutdown_drain_s", "stream_idle_timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        self.cpu_set()  # raises ConfigError on a bad list
        try:
            check_transport(self)
        except TransportError as exc:
            raise ConfigError(str(exc)) from None
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        self.log_level = self.log_level.upper()
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.metrics_address:
            host, colon, port = self.metrics_address.rpartition(":")
            if not colon or not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"--metrics-address must be HOST:PORT (port 0..65535), got {self.metrics_address!r}")
        return self

    def metrics_host_port(self) -> tuple[str, int] | None:
        """``metrics_address`` split for prometheus_client (None: no metrics server)."""
        if not self.metrics_address:
            return None
        host, _, port = self.metrics_address.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)


_PARSERS = {int: int, float: float, str: str}
_BYTE_FIELDS = {"pool_bytes", "max_message_bytes"}
_HELP = {
    "session_ttl_ms": "a session's lease when its client asks for none: it ends (and its sequences are freed) "
    "this long after its last heartbeat",
    "max_session_ttl_ms": "the longest lease a client may ask for",
    "address": "TCP HOST:PORT to listen on (port 0: any free port; empty: no TCP)",
    "unix_socket": "also (or only) listen on this unix socket path",
    "port_file": "write the bound TCP port to this file once listening (for port 0)",
    "pool_bytes": "pool size: bytes or 256MiB, 1GiB, 512MB (KB/MB/GB read as KiB/MiB/GiB); 256MiB when no size "
    "is given",
    "num_blocks": "pool size in blocks (instead of --pool-bytes)",
    "gpu_memory_fraction": "pool size as a fraction of free GPU memory (instead of --pool-bytes)",
    "backend": "where the pool lives: auto (GPU if present, else host), gpu, host",
    "num_layers": "layers of KV per token",
    "num_kv_heads": "KV heads per layer",
    "head_dim": "elements per head",
    "block_size": "tokens per block",
    "dtype": "KV element type",
    "kv_layout": "order of the pool's memory: block-major [blocks, layers, K/V, ...] (a block is one contiguous "
    "span) or layer-major [layers, K/V, blocks, ...] (each layer's K and V is one [blocks, block_size, heads, dim] "
    "tensor, what vLLM/FlashInfer/FlexAttention read); docs/device.md",
    "max_num_seqs": "most live sequences",
    "log_level": "DEBUG, INFO, WARNING, ERROR",
    "log_format": "text, or json: one JSON object a line (for log shippers)",
    "metrics_address": "serve Prometheus metrics on HOST:PORT at /metrics, e.g. 127.0.0.1:9400 (empty: off; "
    "docs/metrics.md)",
    "max_seq_len": "longest sequence in tokens (default min(pool tokens, 32768))",
    "max_batch": "most sequences in one AppendToken / Free (more: INVALID_ARGUMENT)",
    "max_message_bytes": "largest gRPC message received or sent",
    "max_workers": "copy threads: big WriteKV/ReadKV copies and CheckInvariants run there (every call itself runs "
    "on the server's event loop)",
    "max_tokens_per_call": "most tokens one AppendToken (or AppendTokenStream message) may hand out "
    "(more: INVALID_ARGUMENT); bounds how long one call holds the pool",
    "max_streams": "most open streams (AppendTokenStream); more are refused with RESOURCE_EXHAUSTED",
    "event_buffer_batches": "KV event batches kept for SubscribeEvents subscribers resuming with from_seq; one "
    "further behind gets a snapshot instead (docs/prefix-caching.md)",
    "max_event_subscribers": "most open SubscribeEvents streams (they are not counted by --max-streams); more are "
    "refused with RESOURCE_EXHAUSTED",
    "stream_idle_timeout_s": "end a stream that read no message and had no reply taken for this long "
    "(UNAVAILABLE; 0: never)",
    "keepalive_time_s": "ping every client connection this often (finds vanished peers)",
    "keepalive_timeout_s": "a connection whose ping is not answered within this is dead; its calls are cancelled",
    "cpu_affinity": "pin every server thread to these CPUs, e.g. 0 or 0-3,8 (empty: no pinning). The server runs "
    "Python under one GIL, so one core is all it uses; pinning it keeps its threads' caches warm (docs/api.md)",
    "auth_tokens": "tokens file (TOML: sha256 of each token -> tenant, role; tenants' quotas); every call then needs "
    "'authorization: Bearer <token>'; re-read on SIGHUP (docs/security.md)",
    "tls_cert": "PEM certificate (chain) for TLS on the TCP address",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA: mutual TLS, clients must present a certificate it signed",
    "unix_socket_group": "the unix socket is 0600; with a group it is 0660 and that group's",
    "insecure": "allow a non-loopback --address without --auth-tokens or --tls-cert (logged as a warning)",
    "shutdown_grace_s": "seconds in-flight calls get to finish after SIGTERM/SIGINT",
    "shutdown_drain_s": "at shutdown, at most this many seconds of refusing new calls (UNAVAILABLE) before the "
    "listener closes; ends early once clients have gone quiet",
}


def _field_type(field: dataclasses.Field) -> type:
    text = str(field.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float)):
        if text.startswith(name):
            return typ
    return str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool-server",
        description="kvpool: KV-cache block pool of one GPU (or host memory) as a gRPC service. "
        f"Every flag can also be set by an environment variable {ENV_PREFIX}<FLAG> (e.g. KVPOOL_POOL_BYTES).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {server_version()}")
    for field in dataclasses.fields(ServerConfig):
        flag = "--" + field.name.replace("_", "-")
        typ = _field_type(field)
        help_text = _HELP.get(field.name, "")
        if field.default is not None and field.name != "pool_bytes":
            help_text += f" (default {field.default!r})"
        kwargs: dict = {"dest": field.name, "default": None, "help": help_text.strip()}
        if typ is bool:
            kwargs.pop("type", None)
            kwargs["action"] = "store_const"
            kwargs["const"] = True
        elif field.name in _BYTE_FIELDS:
            kwargs["type"] = _bytes_arg
        else:
            kwargs["type"] = typ
        if field.name == "backend":
            kwargs["choices"] = BACKENDS
        if field.name == "dtype":
            kwargs["choices"] = DTYPES
        if field.name == "log_format":
            kwargs["choices"] = LOG_FORMATS
        if field.name == "kv_layout":
            kwargs["choices"] = KV_LAYOUTS
        parser.add_argument(flag, **kwargs)
    return parser


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Flags (``argv``) over ``KVPOOL_*`` variables (``environ``, default os.environ) over defaults; validated."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    values: dict = {}
    for field in dataclasses.fields(ServerConfig):
        value = getattr(args, field.name)
        if value is None:
            raw = environ.get(ENV_PREFIX + field.name.upper())
            if raw is None:
                continue
            value = _parse_env(field, raw)
        values[field.name] = value
    return ServerConfig(**values).validate()


_EXPECTED = {int: "an integer", float: "a number such as 0.5", str: "text"}


def _parse_env(field: dataclasses.Field, raw: str) -> object:
    """A ``KVPOOL_*`` value, or ConfigError naming the variable, its flag and the accepted form."""
    name, flag = ENV_PREFIX + field.name.upper(), "--" + field.name.replace("_", "-")
    if field.name in _BYTE_FIELDS:
        try:
            return parse_bytes(raw)
        except ConfigError:
            raise ConfigError(f"{name}={raw!r} (as {flag}) is not a size: give {BYTES_FORMS}") from None
    typ = _field_type(field)
    if typ is bool:
        if raw.strip().lower() not in ("1", "true", "yes", "0", "false", "no", ""):
            raise ConfigError(f"{name}={raw!r} (as {flag}) must be 1/true/yes or 0/false/no")
        return raw.strip().lower() in ("1", "true", "yes")
    try:
        return _PARSERS[typ](raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} (as {flag}) must be {_EXPECTED[typ]}") from None


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line: ts (ISO 8601, UTC), level, logger, msg, and exc when there is a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


JsonLogFormatter.converter = time.gmtime


def configure_logging(config: ServerConfig) -> None:
    if config.log_format == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonLogFormatter())
        logging.basicConfig(level=config.log_level, handlers=[handler], force=True)
    else:
        logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
