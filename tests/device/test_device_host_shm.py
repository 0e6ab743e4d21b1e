"""The host backend's shared memory: naming, unlink on close, mapping from another process, backend choice."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from kvpool.layout import KVLayout
from kvpool_client.mapping import map_host_pool
from kvpool_server.device import create_pool, pool as pool_module
from kvpool_server.device.host_pool import HostPool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float16")  # 4 KiB blocks
SHM = "/dev/shm"
linux_only = pytest.mark.skipif(not os.path.isdir(SHM), reason="needs /dev/shm")

# A separate interpreter (not a multiprocessing child: those share the parent's resource_tracker, which would hide
# the bug): maps the pool by name, prints the SHA-256 of its bytes, writes a pattern at an offset, exits.
CHILD = r"""
import hashlib, sys
import numpy as np
from kvpool_client.mapping import map_host_pool
name, nbytes, offset, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pool = map_host_pool(name, nbytes)
print(hashlib.sha256(pool.flat.tobytes()).hexdigest(), flush=True)
pool.flat[offset:offset + 4096] = np.random.default_rng(seed).integers(1, 256, 4096, dtype=np.uint8)
pool.close()
"""


def run_child(code: str, *args: object) -> str:
    result = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@linux_only
def test_host_pool_is_named_shared_memory_unlinked_on_close() -> None:
    pool = create_pool(LAYOUT, backend="host", num_blocks=8)
    name = pool.attach_info().shm_name
    assert re.fullmatch(rf"kvpool-{os.getpid()}-[0-9]+-[0-9]+-[0-9a-f]+", name)
    assert os.path.getsize(os.path.join(SHM, name)) == pool.pool_bytes == 8 * LAYOUT.block_bytes
    pool.close()
    assert not os.path.exists(os.path.join(SHM, name))
    pool.close()  # idempotent
    with pytest.raises(FileNotFoundError):
        map_host_pool(name, 8 * LAYOUT.block_bytes)


def test_two_pools_get_distinct_names() -> None:
    with create_pool(LAYOUT, backend="host", num_blocks=2) as a, create_pool(LAYOUT, backend="host", num_blocks=2) as b:
        assert a.attach_info().shm_name != b.attach_info().shm_name


@linux_only
def test_another_process_maps_the_pool_sees_and_writes_the_same_bytes_and_does_not_unlink_it() -> None:
    rng = np.random.default_rng(7)
    with create_pool(LAYOUT, backend="host", num_blocks=16) as pool:
        info = pool.attach_info()
        flat = pool.blocks.reshape(-1).view(np.uint8)
        flat[...] = rng.integers(1, 256, flat.size, dtype=np.uint8)
        offset = 5 * LAYOUT.block_bytes + 512
        ours = hashlib.sha256(flat.tobytes()).hexdigest()

        digest = run_child(CHILD, info.shm_name, info.pool_bytes, offset, 11)

        assert digest == ours  # the child saw our bytes
        written = np.random.default_rng(11).integers(1, 256, 4096, dtype=np.uint8)
        assert np.array_equal(flat[offset : offset + 4096], written)  # we see the child's bytes
        # the child's exit unlinked nothing: the name is still there and maps to the same memory
        assert os.path.exists(os.path.join(SHM, info.shm_name))
        with map_host_pool(info.shm_name, info.pool_bytes) as again:
            assert np.array_equal(again.flat, flat)
            blocks = again.blocks(LAYOUT)
            assert blocks.shape == pool.blocks.shape
            assert np.array_equal(blocks.view(np.uint16), pool.blocks.view(np.uint16))  # bits: random may be NaN
        assert np.array_equal(pool.read_slots([5 * 16 + 1])[0].reshape(-1).view(np.uint8)[:16],
                              flat[5 * LAYOUT.block_bytes + 64 : 5 * LAYOUT.block_bytes + 80])


@linux_only
def test_a_mapping_of_the_wrong_size_is_refused() -> None:
    with create_pool(LAYOUT, backend="host", num_blocks=2) as pool:
        with pytest.raises(ValueError, match="fewer"):
            map_host_pool(pool.attach_info().shm_name, pool.pool_bytes + 1)


@linux_only
def test_the_segment_is_unlinked_when_its_owner_dies_without_closing() -> None:
    code = r"""
import os
from kvpool.layout import KVLayout
from kvpool_server.device.host_pool import HostPool
pool = HostPool(KVLayout(), 4)
print(pool.shm_name, flush=True)
os._exit(0)
"""
    name = run_child(code)
    path = os.path.join(SHM, name)
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:  # the owner's resource_tracker cleans up
        time.sleep(0.05)
    assert not os.path.exists(path)


def test_arrays_alive_after_close_stay_readable() -> None:
    pool = HostPool(LAYOUT, 2)
    k, _ = pool.layer_kv(0)
    k[...] = 3
    pool.close()
    assert float(k[1, 2, 1, 5]) == 3.0  # still mapped (the name is gone), not a dangling pointer


def test_auto_backend_picks_host_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "gpu_available", lambda: False)
    with create_pool(LAYOUT, num_blocks=2) as pool:
        assert pool.backend == "host"


def test_auto_backend_follows_gpu_availability() -> None:
    with create_pool(LAYOUT, num_blocks=2) as pool:
        assert pool.backend == ("gpu" if pool_module.gpu_available() else "host")


def test_sizing_takes_exactly_one_of_bytes_blocks_fraction() -> None:
    resolve = pool_module.resolve_num_blocks
    bb = LAYOUT.block_bytes
    assert resolve(LAYOUT, None, pool_bytes=10 * bb + bb - 1) == 10
    assert resolve(LAYOUT, None, num_blocks=7) == 7
    assert resolve(LAYOUT, 100 * bb, gpu_memory_fraction=0.5) == 50
    for kwargs in ({}, {"pool_bytes": bb, "num_blocks": 1}):
        with pytest.raises(ValueError, match="exactly one"):
            resolve(LAYOUT, None, **kwargs)
    for kwargs in ({"pool_bytes": bb - 1}, {"num_blocks": 0}):
        with pytest.raises(ValueError, match="at least one block"):
            resolve(LAYOUT, None, **kwargs)
    with pytest.raises(ValueError, match="fraction"):
        resolve(LAYOUT, 100 * bb, gpu_memory_fraction=1.5)
    with pytest.raises(ValueError, match="backend"):
        create_pool(LAYOUT, backend="tpu", num_blocks=1)
    with create_pool(LAYOUT, backend="host", pool_bytes=3 * bb + 5) as pool:
        assert (pool.num_blocks, pool.pool_bytes) == (3, 3 * bb)
