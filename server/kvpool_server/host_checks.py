"""What the settings need of this host, checked apart from ServerConfig.validate() (which reads nothing of the OS):

* ``check_environment(config)`` (load_config runs it): the files named exist (TLS, tokens), the CPUs of
  ``--cpu-affinity`` are ones this process may use.
* ``check_pool_fits(config)`` (at start, before the pool is made): a host-backend pool fits the free space of
  /dev/shm, and it and the host tier fit the memory the host (or its cgroup) has available -- a message naming the
  setting before anything is made (Docker gives a container 64 MiB of /dev/shm unless told otherwise). The pool's
  pages are reserved when it is made (shm_segments), so a /dev/shm filled meanwhile fails the start too, never a
  later write with SIGBUS; a pool and tier bigger than the memory would grow until the host swaps or the OOM killer
  comes. A GPU pool's device memory is CuPy's to refuse (``pool_error_message`` says what
  to do then).

Each raises ConfigError naming the setting and what to do.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvpool.tensor_parallel import group_block_bytes
from kvpool_server.settings import ConfigError, format_bytes
from kvpool_server.exposure import TransportError, check_transport_files
from kvpool_server.shm_segments import SHM_DIR

if TYPE_CHECKING:
    from kvpool_server.config import ServerConfig

SHM_ADVICE = ("give the container more: `docker run --shm-size=1g`, or `shm_size: 1gb` under the service in compose "
              "(docker/compose.yaml sets it); on a host, `mount -o remount,size=2G /dev/shm`")


def check_environment(config: ServerConfig) -> None:
    """The files ``config`` names exist, and this process may run on the CPUs of ``--cpu-affinity``."""
    try:
        check_transport_files(config)
    except TransportError as exc:
        raise ConfigError(str(exc)) from None
    cpus = config.cpu_set()
    if cpus is not None:
        allowed = os.sched_getaffinity(0)
        if not cpus <= allowed:
            raise ConfigError(
                f"--cpu-affinity names CPUs {sorted(cpus - allowed)} this process may not use "
                f"(allowed: {sorted(allowed)})"
            )


def available_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process may still fill: MemAvailable, or less where a cgroup v2 memory.max (a container's
    limit) leaves less. None when /proc/meminfo cannot be read."""
    available = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open(os.path.join(cgroup, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(cgroup, "memory.current")) as f:
            used = int(f.read().strip())
        if limit.isdigit() and available is not None:
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def shm_free_bytes(statvfs: Callable[[str], Any] = os.statvfs) -> int:
    st = statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def planned_pool_bytes(config: ServerConfig, shm_free: int) -> tuple[int, str]:
    """The bytes a host pool of ``config`` takes (whole blocks, as create_pool rounds), and the setting that asked
    for them, in words for a message."""
    sizing = config.pool_size_kwargs()
    block_bytes = group_block_bytes(config.layout, config.tensor_parallel)  # all ranks' shards of a block
    if "num_blocks" in sizing:
        size = config.num_blocks * block_bytes if config.num_blocks else 0
        return size, f"--num-blocks {config.num_blocks} ({format_bytes(size)})"
    if "gpu_memory_fraction" in sizing:
        size = int(shm_free * sizing["gpu_memory_fraction"]) // block_bytes * block_bytes
        return size, f"--gpu-memory-fraction {config.gpu_memory_fraction} ({format_bytes(size)})"
    asked = int(sizing["pool_bytes"])
    size = asked // block_bytes * block_bytes
    if config.pool_bytes is None:
        return size, f"the default pool size ({format_bytes(asked)}; --pool-bytes sets it)"
    return size, f"--pool-bytes {format_bytes(asked)}"


def check_pool_fits(config: ServerConfig, backend: str | None = None, *,
                    statvfs: Callable[[str], Any] = os.statvfs,
                    memory: Callable[[], int | None] = available_memory) -> None:
    """Refuse a host-backend pool larger than the free space of /dev/shm, or a host-backend pool and the host tier
    together larger than the available memory (the tier is host memory on either backend, taken as it is made:
    ``HostTierPool`` populates its chunks, the GPU backend pins them). ``backend``: the one the pool will use
    ("auto" is resolved here, as create_pool resolves it); ``statvfs`` and ``memory`` read the host (tests pass
    others). The pool and each fast-path channel also reserve their pages when made (shm_segments): what this
    check lets through and something else takes meanwhile fails there, with a message, never with SIGBUS."""
    backend = config.backend if backend is None else backend
    if backend == "auto":
        from kvpool_server.device.pool import gpu_available

        backend = "gpu" if gpu_available() else "host"
    tier = config.host_tier_bytes // config.layout.block_bytes * config.layout.block_bytes
    if backend != "host":
        available = memory() if tier else None
        if available is not None and tier > available:
            raise ConfigError(
                f"--host-tier-bytes {format_bytes(tier)} is more than the memory this host has available "
                f"({format_bytes(available)}): give a smaller --host-tier-bytes (or 0: no host tier)")
        return
    shm_free = shm_free_bytes(statvfs)
    size, what = planned_pool_bytes(config, shm_free)
    available = memory()
    if available is not None and size + tier > available:
        both = f"{what} and --host-tier-bytes {format_bytes(tier)} are" if tier else f"{what} is"
        raise ConfigError(
            f"{both} more than the memory this host has available ({format_bytes(available)}): a host-backend "
            "pool lives in RAM (/dev/shm) and would push the host into swap or the OOM killer as it fills. Give a "
            f"smaller --pool-bytes (or --num-blocks){', a smaller --host-tier-bytes' if tier else ''}, or run on "
            "the GPU (--backend gpu)"
        )
    if size > shm_free:
        raise ConfigError(
            f"{what} does not fit {SHM_DIR}: {format_bytes(shm_free)} free there. A host-backend pool is a {SHM_DIR} "
            "segment, and the first write past the free space would kill the server with SIGBUS. Give a smaller "
            f"--pool-bytes, or a larger {SHM_DIR}: {SHM_ADVICE}"
        )


def pool_error_message(backend: str, exc: BaseException) -> str:
    """What to tell the user when ``create_pool`` failed: the error, and what to do about it (``build_servicer``
    raises ``StartupError`` with it)."""
    text = f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc)
    cuda_words = ("cuda", "cupy", "nvrtc", "libcu", "driver")
    if "out of memory" in text.lower():
        return (f"cannot create the {backend} pool: {text}: give a smaller --pool-bytes, --num-blocks or "
                "--gpu-memory-fraction")
    if backend == "gpu" and (isinstance(exc, ImportError) or any(w in text.lower() for w in cuda_words)):
        return (f"cannot create the gpu pool: no CUDA GPU/driver found ({text}): use --backend host or auto "
                "(KVPOOL_BACKEND=host), or install CuPy for this CUDA (`make setup GPU=1`, requirements/gpu.txt)")
    if "/dev/shm" in text or isinstance(exc, OSError) and backend != "gpu":
        return (f"cannot create the {backend} pool: {text} (host pools live in /dev/shm: is it large enough? "
                "use a smaller --pool-bytes, or give the container more --shm-size)")
    return f"cannot create the {backend} pool: {text}"
