"""ServerConfig: every setting of kvpool-server, from flags, KVPOOL_* environment variables and defaults.

Precedence: a command-line flag beats its environment variable (``--pool-bytes`` <- ``KVPOOL_POOL_BYTES``), which
beats the default. ``ServerConfig.validate()`` rejects a configuration that cannot work, with a message naming the
setting, before anything is bound or allocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpool.layout import KV_LAYOUTS, KVLayout

ENV_PREFIX = "KVPOOL_"
BACKENDS = ("auto", "gpu", "host")
DTYPES = ("float32", "float16", "bfloat16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_POOL_BYTES = 256 << 20
_SUFFIXES = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


class ConfigError(ValueError):
    """A setting that cannot work; the message names it."""


def parse_bytes(text: str | int) -> int:
    """``"268435456"``, ``"256MiB"``, ``"256m"``, ``"1GiB"`` -> bytes."""
    if isinstance(text, int):
        return text
    value = text.strip().lower().replace("_", "")
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if value.endswith(suffix):
            return int(float(value[: -len(suffix)]) * _SUFFIXES[suffix])
    return int(value)


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
    max_workers: int = 8  # server threads
    shutdown_grace_s: float = 10.0
    shutdown_drain_s: float = 2.0
    log_level: str = "INFO"
    # CPUs every server thread runs on, e.g. "0" or "0-3,8"; "" leaves the scheduler free. See cpu_set().
    cpu_affinity: str = ""

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
                     "max_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ConfigError(f"--max-seq-len must be >= 1, got {self.max_seq_len}")
        if self.max_message_bytes < 64 << 10:
            raise ConfigError(f"--max-message-bytes must be >= 65536, got {self.max_message_bytes}")
        if self.layout.token_bytes > self.max_message_bytes // 2:
            raise ConfigError(f"one token's KV ({self.layout.token_bytes} bytes) does not fit --max-message-bytes")
        for name in ("shutdown_grace_s", "shutdown_drain_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        self.cpu_set()  # raises ConfigError on a bad list
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        self.log_level = self.log_level.upper()
        return self


_PARSERS = {int: int, float: float, str: str}
_BYTE_FIELDS = {"pool_bytes", "max_message_bytes"}
_HELP = {
    "address": "TCP HOST:PORT to listen on (port 0: any free port; empty: no TCP)",
    "unix_socket": "also (or only) listen on this unix socket path",
    "port_file": "write the bound TCP port to this file once listening (for port 0)",
    "pool_bytes": "pool size in bytes, suffixes KiB/MiB/GiB allowed (256MiB when no size is given)",
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
    "max_seq_len": "longest sequence in tokens (default min(pool tokens, 32768))",
    "max_batch": "most sequences in one AppendToken / Free (more: INVALID_ARGUMENT)",
    "max_message_bytes": "largest gRPC message received or sent",
    "max_workers": "gRPC server threads",
    "cpu_affinity": "pin every server thread to these CPUs, e.g. 0 or 0-3,8 (empty: no pinning). The server runs "
    "Python under one GIL, so one core is all it uses; pinning it keeps its threads' caches warm (docs/api.md)",
    "shutdown_grace_s": "seconds in-flight calls get to finish after SIGTERM/SIGINT",
    "shutdown_drain_s": "at shutdown, at most this many seconds of refusing new calls (UNAVAILABLE) before the "
    "listener closes; ends early once clients have gone quiet",
}


def _field_type(field: dataclasses.Field) -> type:
    text = str(field.type)
    for name, typ in (("int", int), ("float", float)):
        if text.startswith(name):
            return typ
    return str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool-server",
        description="kvpool: KV-cache block pool of one GPU (or host memory) as a gRPC service. "
        f"Every flag can also be set by an environment variable {ENV_PREFIX}<FLAG> (e.g. KVPOOL_POOL_BYTES).",
    )
    for field in dataclasses.fields(ServerConfig):
        flag = "--" + field.name.replace("_", "-")
        typ = _field_type(field)
        help_text = _HELP.get(field.name, "")
        if field.default is not None and field.name != "pool_bytes":
            help_text += f" (default {field.default!r})"
        kwargs: dict = {"dest": field.name, "default": None, "help": help_text.strip()}
        if field.name in _BYTE_FIELDS:
            kwargs["type"] = parse_bytes
        else:
            kwargs["type"] = typ
        if field.name == "backend":
            kwargs["choices"] = BACKENDS
        if field.name == "dtype":
            kwargs["choices"] = DTYPES
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
            try:
                value = parse_bytes(raw) if field.name in _BYTE_FIELDS else _PARSERS[_field_type(field)](raw)
            except ValueError as exc:
                raise ConfigError(f"{ENV_PREFIX}{field.name.upper()}={raw!r}: {exc}") from exc
        values[field.name] = value
    return ServerConfig(**values).validate()


def configure_logging(config: ServerConfig) -> None:
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
