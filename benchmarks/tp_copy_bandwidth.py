"""Copy-on-write copy bandwidth per device with N shards copying at once: ``pool.copy_blocks`` of a ShardedPool,
which starts every device's copy (one kernel launch for the shards of a device) before it waits for any, against a
plain memcpy of the same bytes on each device at once.

    python benchmarks/tp_copy_bandwidth.py --backend gpu                 # N shards on device 0
    python benchmarks/tp_copy_bandwidth.py --backend gpu --tp-devices 0,1,2,3,4,5,6,7

Per N: ``--copies`` random (src, dst) pairs of whole blocks (sources in one half of the pool, destinations in the
other), Llama-3-8B layout (2 MiB blocks over all ranks, 2 MiB / N a shard). Bandwidth counts bytes read + written
on one device, over the wall time of the call (validation, upload, a launch and a synchronisation a device: what
the server pays), median of ``--reps``; memcpy is one ``cudaMemcpyAsync`` D2D of the same bytes per device, all
devices started before any is waited for. The host backend runs the same code as a smoke test (NumPy copies; memcpy: one
NumPy copy of the same bytes). Every copy is checked once after the timed runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from kvpool.layout import KVLayout
from kvpool.tensor_parallel import shard_layout
from kvpool_server.device import create_pool

LLAMA = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
SMALL = KVLayout(num_layers=2, num_kv_heads=8, head_dim=16, block_size=16, dtype="float16")


def timed(fn: Any, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def memcpy_seconds(backend: str, devices: list[int], nbytes: int, reps: int) -> float:
    """One D2D memcpy of ``nbytes`` on each device, started on all before waiting for any."""
    if backend != "gpu":
        src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        return timed(lambda: np.copyto(dst, src), reps)
    import cupy

    spans = []
    for d in devices:
        with cupy.cuda.Device(d):
            spans.append((d, cupy.cuda.Memory(nbytes), cupy.cuda.Memory(nbytes), cupy.cuda.Stream(non_blocking=True)))

    def run() -> None:
        for d, src, dst, stream in spans:
            with cupy.cuda.Device(d):
                cupy.cuda.runtime.memcpyAsync(dst.ptr, src.ptr, nbytes, 3, stream.ptr)  # 3: device to device
        for d, _src, _dst, stream in spans:
            with cupy.cuda.Device(d):
                stream.synchronize()

    return timed(run, reps)


def run(backend: str, layout: KVLayout, n: int, copies: int, reps: int, devices: list[int]) -> dict:
    rng = np.random.default_rng(n)
    pool = create_pool(layout, backend=backend, num_blocks=2 * copies, tensor_parallel=n,
                       devices=devices if backend == "gpu" else None)
    try:
        src = rng.permutation(copies)
        dst = copies + rng.permutation(copies)
        pairs = np.stack([src, dst], axis=1).astype(np.int32)
        tokens = rng.integers(1, 255, size=(copies, *layout.token_shape), dtype=np.uint8).astype(
            layout.storage_dtype)  # one token a block, checked after the timed copies
        pool.write_slots(src.astype(np.int64) * layout.block_size, tokens)
        seconds = timed(lambda: pool.copy_blocks(pairs), reps)
        ok = bool(np.array_equal(pool.read_slots(dst.astype(np.int64) * layout.block_size), tokens))
    finally:
        pool.close()
    shard_bytes = shard_layout(layout, n).block_bytes if n > 1 else layout.block_bytes  # one rank's part of a block
    ndev = len(set(devices)) if backend == "gpu" else 1
    per_device = 2 * copies * shard_bytes * n // ndev  # read + written on one device
    mem = memcpy_seconds(backend, sorted(set(devices)) if backend == "gpu" else [0], per_device // 2, reps)
    return {"tensor_parallel": n, "devices": ndev, "seconds": seconds, "per_device_gbs": per_device / seconds / 1e9,
            "memcpy_gbs": per_device / mem / 1e9, "vs_memcpy": mem / seconds, "correct": ok}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("host", "gpu"), default="host")
    parser.add_argument("--tensor-parallel", default="1,2,4,8")
    parser.add_argument("--tp-devices", default="", help="CUDA device of each rank of the largest N (default: 0)")
    parser.add_argument("--copies", type=int, default=None, help="default: 1024 (gpu), 256 (host)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", help="write the rows to this file")
    a = parser.parse_args()
    layout = LLAMA if a.backend == "gpu" else SMALL
    copies = a.copies or (1024 if a.backend == "gpu" else 256)
    all_devices = [int(d) for d in a.tp_devices.split(",")] if a.tp_devices else []
    print(f"copy_blocks of {copies} blocks ({layout.block_bytes >> 10} KiB a block over all ranks), {a.backend} "
          f"backend, {'devices ' + a.tp_devices if all_devices else 'every shard on device 0'}; median of {a.reps}")
    rows = []
    for n in (int(x) for x in a.tensor_parallel.split(",")):
        devices = all_devices[:n] if all_devices else [0] * n
        row = run(a.backend, layout, n, copies, a.reps, devices)
        rows.append(row)
        print(f"  N={n} on {row['devices']} device(s): {row['seconds'] * 1e6:9.1f} us  {row['per_device_gbs']:7.1f} "
              f"GB/s a device  memcpy {row['memcpy_gbs']:7.1f} GB/s  x{row['vs_memcpy']:.2f} of memcpy  "
              f"{'correct' if row['correct'] else 'WRONG'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"backend": a.backend, "copies": copies, "rows": rows}, f, indent=1)
    if not all(row["correct"] for row in rows):
        raise SystemExit("a copy was wrong")


if __name__ == "__main__":
    main()
