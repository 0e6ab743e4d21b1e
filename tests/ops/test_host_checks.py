"""A host pool that does not fit the host is refused at start, with the setting and what to do (issue 20, item 9).

Without the check, a 256 MiB pool under Docker's default 64 MiB /dev/shm starts (the segment is sparse) and dies of
SIGBUS at the first write past 64 MiB, and a pool larger than the memory grows until the host swaps.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from types import SimpleNamespace

import pytest

from kvpool_server.config import ConfigError, ServerConfig
from kvpool_server.host_checks import available_memory, check_pool_fits, planned_pool_bytes, pool_error_message
from tests.conftest import server_command

MiB, GiB = 1 << 20, 1 << 30


def statvfs_free(free: int):
    """A statvfs that reports ``free`` bytes available (4 KiB blocks), as /dev/shm would."""
    return lambda path: SimpleNamespace(f_bavail=free // 4096, f_frsize=4096)


def check(config: ServerConfig, *, shm: int, memory: int | None, backend: str = "host") -> None:
    check_pool_fits(config, backend, statvfs=statvfs_free(shm), memory=lambda: memory)


def test_dockers_default_shm_refuses_the_default_pool():
    with pytest.raises(ConfigError) as info:
        check(ServerConfig(backend="host"), shm=64 * MiB, memory=16 * GiB)
    message = str(info.value)
    assert message.startswith("the default pool size (256MiB; --pool-bytes sets it) does not fit /dev/shm: 64MiB")
    for words in ("SIGBUS", "--shm-size", "shm_size", "smaller --pool-bytes"):
        assert words in message


@pytest.mark.parametrize("changes, named", [({"pool_bytes": 100 * MiB}, "--pool-bytes 100MiB"),
                                            ({"num_blocks": 10_000}, "--num-blocks 10000 (78.12MiB)")])
def test_the_message_names_the_setting_that_sized_the_pool(changes, named):
    with pytest.raises(ConfigError, match="^" + re.escape(named) + " does not fit /dev/shm"):
        check(ServerConfig(**changes), shm=64 * MiB, memory=16 * GiB)


def test_more_than_the_memory_is_refused_before_shm_is_looked_at():
    with pytest.raises(ConfigError) as info:
        check(ServerConfig(pool_bytes=1 << 40), shm=2 << 40, memory=24 * GiB)
    assert str(info.value).startswith("--pool-bytes 1TiB is more than the memory this host has available (24GiB)")


def test_a_pool_that_fits_passes():
    check(ServerConfig(pool_bytes=64 * MiB), shm=64 * MiB, memory=64 * MiB)  # exactly: passes
    check(ServerConfig(gpu_memory_fraction=0.5), shm=64 * MiB, memory=32 * MiB)  # half of the free /dev/shm
    check(ServerConfig(pool_bytes=64 * MiB), shm=64 * MiB, memory=None)  # MemAvailable unreadable: /dev/shm only
    with pytest.raises(ConfigError, match="does not fit /dev/shm"):
        check(ServerConfig(pool_bytes=65 * MiB), shm=64 * MiB, memory=None)


def test_a_gpu_pool_is_left_to_cupy():
    """Device memory is CuPy's to refuse; its OutOfMemoryError gets advice naming the sizing flags."""
    check(ServerConfig(pool_bytes=1 << 40), shm=64 * MiB, memory=MiB, backend="gpu")
    message = pool_error_message("gpu", MemoryError("Out of memory allocating 1,099,511,627,776 bytes"))
    assert "Out of memory allocating" in message
    assert "smaller --pool-bytes, --num-blocks or --gpu-memory-fraction" in message


def test_pool_bytes_are_whole_blocks():
    config = ServerConfig(pool_bytes=8192 * 3 + 100)  # 8 KiB blocks: 3 of them
    assert planned_pool_bytes(config, shm_free=0)[0] == 3 * 8192


def test_available_memory_reads_meminfo_and_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683584 kB\nMemFree:        1000 kB\nMemAvailable:   2097152 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(str(meminfo), str(cgroup)) == 2 * GiB  # no cgroup files: MemAvailable
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(f"{GiB}\n")
    assert available_memory(str(meminfo), str(cgroup)) == 2 * GiB  # no limit
    (cgroup / "memory.max").write_text(f"{GiB + 512 * MiB}\n")
    assert available_memory(str(meminfo), str(cgroup)) == 512 * MiB  # the container's limit leaves less
    assert available_memory(str(tmp_path / "none"), str(cgroup)) is None
    assert available_memory() is not None  # this host's


def test_a_pool_larger_than_the_memory_is_refused_by_the_real_server():
    """The real process, this host's /proc/meminfo: exit 1 at once with the message, no segment left behind (before
    the check, the server started and listened with a sparse 1 TiB segment)."""
    args = ["--backend", "host", "--pool-bytes", "1TiB", "--address", "127.0.0.1:0"]
    proc = subprocess.Popen(server_command() + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, stderr
    assert "kvpool-server: --pool-bytes 1TiB is more than the memory this host has available" in stderr
    assert "Traceback" not in stderr
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"kvpool-{proc.pid}-")]


def test_the_host_tier_counts_with_the_pool_against_the_memory():
    check(ServerConfig(pool_bytes=64 * MiB, host_tier_bytes=32 * MiB), shm=64 * MiB, memory=96 * MiB)  # exactly
    with pytest.raises(ConfigError) as info:
        check(ServerConfig(pool_bytes=64 * MiB, host_tier_bytes=33 * MiB), shm=64 * MiB, memory=96 * MiB)
    assert str(info.value).startswith("--pool-bytes 64MiB and --host-tier-bytes 33MiB are more than the memory")
    with pytest.raises(ConfigError, match="^--host-tier-bytes 1TiB is more than the memory"):
        check(ServerConfig(host_tier_bytes=1 << 40), shm=0, memory=24 * GiB, backend="gpu")


def test_a_host_tier_larger_than_the_memory_is_refused_by_the_real_server():
    """Before, the server started with a small pool and a 1 TiB tier, whose chunks failed (or were overcommitted)
    later, in the background."""
    args = ["--backend", "host", "--pool-bytes", "2MiB", "--host-tier-bytes", "1TiB", "--address", "127.0.0.1:0"]
    proc = subprocess.Popen(server_command() + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, stderr
    assert "--pool-bytes 2MiB and --host-tier-bytes 1TiB are more than the memory this host has available" in stderr


def resident_anonymous_mappings(pid: int) -> list[tuple[int, int]]:
    """(size, rss) in bytes of each anonymous mapping of process ``pid`` (/proc/PID/smaps)."""
    found, current = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line: its range, perms, ... path
                current = [0, 0] if len(head) == 5 else None
                if current is not None:
                    found.append(current)
            elif current is not None and head[0] in ("Size:", "Rss:"):
                current[head[0] == "Rss:"] = int(head[1]) * 1024
    return [(size, rss) for size, rss in found]


def test_the_host_tier_takes_its_memory_as_it_is_made(server_factory):
    """The tier's chunks (64 MiB each) are populated when made, not at some later offload: a calloc'd chunk was a
    mapping of 64 MiB with a few KiB resident."""
    from kvpool.v1 import kvpool_pb2 as pb
    from tests.service.service_helpers import connect

    server = server_factory("--host-tier-bytes", "64MiB")
    with connect(server.address) as stub:
        deadline = time.monotonic() + 30
        while stub.Stats(pb.StatsRequest()).host_tier.num_blocks_ready < 64 * MiB // 8192:
            assert time.monotonic() < deadline, "the tier was not ready in 30 s"
            time.sleep(0.05)
    chunks = [(size, rss) for size, rss in resident_anonymous_mappings(server.pid) if size >= 64 * MiB]
    assert any(rss >= 64 * MiB for _, rss in chunks), f"no resident 64 MiB mapping: {chunks}"
