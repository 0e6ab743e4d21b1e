#!/usr/bin/env python3
"""The cost of ``pool.zero_blocks`` (clearing blocks that change hands, issue 20) against a plain memset.

    python benchmarks/bench_zero.py                       host backend (shared memory), small pools: any machine
    python benchmarks/bench_zero.py --backend gpu         GPU backend (CuPy), 16 GiB pools: the H200

For n = 1, 16, 64, 256, 4096 blocks, at the server's default layout (1 layer, 1 KV head, head_dim 64, fp32, 16-token
blocks: 8 KiB) and a Llama-3-8B-like one (32 layers, 8 KV heads, head_dim 128, fp16, 16-token blocks: 2 MiB), with
the ids either *scattered* (random even ids: n runs of one block) or *contiguous* (one run). Sizes that do not fit
the pool (``n > num_blocks / 2``) are skipped. ``--kv-layout layer-major`` runs the layer-major order instead.

Columns (medians over rotating id sets, so no call repeats the previous one's ids):

- ``path`` (GPU): how ``zero_blocks`` cleared them: ``memset`` (one run, block-major or 1 layer) or ``kernel``.
- ``call us``: wall time of one ``pool.zero_blocks(ids)`` -- validation, run coalescing (host) or the id upload,
  the launch (or memsets) and the stream synchronisation (GPU): what the serving path pays per call.
- ``dev us`` (GPU): device time of the zero kernel alone (whatever the path), 20 launches captured in a CUDA graph,
  CUDA events around its replay, / 20.
- ``GB/s``: bytes zeroed / (dev us on GPU, call us on the host).
- ``memset``: one ``cudaMemsetAsync`` (GPU, events the same way) or one NumPy ``[:] = 0`` (host) of the same number
  of contiguous bytes of the pool, in the same run: the bandwidth ceiling. ``vs memset`` = its time / ours.
- ``per-run`` (GPU): the alternative, one ``cudaMemsetAsync`` per run of consecutive ids (2L per run layer-major),
  host wall per call (enqueue + sync) and device time (graph); "-" where it would take more than 5 000 memsets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "common"), str(ROOT / "client")]

import numpy as np  # noqa: E402

from kvpool.layout import KVLayout  # noqa: E402
from kvpool_server.device import create_pool  # noqa: E402
from kvpool_server.device.host_pool import block_runs  # noqa: E402

COUNTS = (1, 16, 64, 256, 4096)
NUM_SETS = 8  # id sets rotated over
LAUNCHES, REPEATS = 20, 9  # device timing: events around LAUNCHES back-to-back launches, median of REPEATS
MAX_MEMSETS = 5_000


def layouts(kv_layout: str) -> dict[str, KVLayout]:
    return {"default 8 KiB": KVLayout(1, 1, 64, 16, "float32", kv_layout),
            "llama-3-8b 2 MiB": KVLayout(32, 8, 128, 16, "float16", kv_layout)}


def id_sets(num_blocks: int, n: int, pattern: str, rng: np.random.Generator) -> list[np.ndarray]:
    if pattern == "contiguous":
        starts = rng.integers(0, num_blocks - n + 1, NUM_SETS)
        return [np.arange(s, s + n, dtype=np.int32) for s in starts]
    return [(rng.choice(num_blocks // 2, n, replace=False) * 2).astype(np.int32) for _ in range(NUM_SETS)]


def wall_us(call: Callable[[int], Any], n: int) -> float:
    for i in range(3):
        call(i)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def device_us(enqueue: Callable[[int], Any], stream: Any) -> float:
    """Median device time of one enqueue: LAUNCHES enqueues captured in a CUDA graph, CUDA events around its
    replay (a graph, so that the host's launch rate -- ~5-10 us a CuPy launch -- does not show as GPU time)."""
    import cupy

    for i in range(3):
        enqueue(i)
    stream.synchronize()
    stream.begin_capture()
    for i in range(LAUNCHES):
        enqueue(i)
    graph = stream.end_capture()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    samples = []
    for _ in range(REPEATS):
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / LAUNCHES)
    return statistics.median(samples)


def bench_host(pool: Any, n: int, sets: list[np.ndarray], calls: int) -> dict[str, Any]:
    nbytes = n * pool.layout.block_bytes
    flat = np.frombuffer(pool._mmap, dtype=np.uint8)
    call = wall_us(lambda i: pool.zero_blocks(sets[i % NUM_SETS]), calls)
    regions = max(1, min(NUM_SETS, pool.pool_bytes // nbytes))  # rotate as the id sets do (caches, TLB)
    memset = wall_us(lambda i: flat.__setitem__(slice(i % regions * nbytes, (i % regions + 1) * nbytes), 0), calls)
    return {"call_us": call, "gbps": nbytes / call / 1e3, "memset_us": memset, "memset_gbps": nbytes / memset / 1e3}


def bench_gpu(pool: Any, n: int, sets: list[np.ndarray], calls: int) -> dict[str, Any]:
    import cupy

    layout, stream = pool.layout, pool._stream
    nbytes = n * layout.block_bytes
    row: dict[str, Any] = {"path": "memset" if pool.zeroes_by_memset(sets[0]) else "kernel",
                           "call_us": wall_us(lambda i: pool.zero_blocks(sets[i % NUM_SETS]), calls)}
    with pool.device:
        dev_sets = [cupy.asarray(s) for s in sets]  # uploaded once: the kernel alone is timed
        row["dev_us"] = device_us(lambda i: pool.zeroer.launch(pool._base_ptr, dev_sets[i % NUM_SETS].data.ptr, n,
                                                               stream), stream)
        row["gbps"] = nbytes / row["dev_us"] / 1e3
        regions = max(1, min(NUM_SETS, pool.pool_bytes // nbytes))  # rotate as the id sets do (L2)
        row["memset_us"] = device_us(lambda i: cupy.cuda.runtime.memsetAsync(
            pool._base_ptr + (i % regions) * nbytes, 0, nbytes, stream.ptr), stream)
        row["memset_gbps"] = nbytes / row["memset_us"] / 1e3
        block_stride, seg_stride = layout.strides(pool.num_blocks)
        spans, span_bytes = layout.copy_spans(pool.num_blocks)
        runs = [block_runs(s) for s in sets]
        if len(runs[0][0]) * spans <= MAX_MEMSETS:

            def per_run(i: int) -> None:
                for start, end in zip(*runs[i % NUM_SETS]):
                    for span in range(spans):
                        cupy.cuda.runtime.memsetAsync(pool._base_ptr + int(start) * block_stride + span * seg_stride,
                                                      0, int(end - start) * span_bytes, stream.ptr)

            def per_run_sync(i: int) -> None:
                per_run(i)
                stream.synchronize()

            row["per_run_call_us"] = wall_us(per_run_sync, max(5, calls // 4))
            row["per_run_dev_us"] = device_us(per_run, stream)
    return row


def fmt(row: dict[str, Any], key: str, digits: int = 1) -> str:
    return f"{row[key]:.{digits}f}" if key in row else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("host", "gpu"), default="host")
    parser.add_argument("--kv-layout", choices=("block-major", "layer-major"), default="block-major")
    parser.add_argument("--pool-gib", type=float, default=None, help="pool size per layout (host 0.25, gpu 16)")
    parser.add_argument("--calls", type=int, default=None, help="wall-clock samples per size (host 20, gpu 200)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    gpu = args.backend == "gpu"
    pool_bytes = int((args.pool_gib or (16 if gpu else 0.25)) * (1 << 30))
    calls = args.calls or (200 if gpu else 20)
    rng = np.random.default_rng(0)
    results = []
    for name, layout in layouts(args.kv_layout).items():
        with create_pool(layout, backend=args.backend, pool_bytes=pool_bytes) as pool:
            if gpu:
                device = pool.device
                print(f"\n{name} ({args.kv_layout}), {pool.num_blocks} blocks, GPU {device.id} "
                      f"({__import__('cupy').cuda.runtime.getDeviceProperties(device.id)['name'].decode()})")
                print(f"{'ids':>10} {'n':>5} {'MiB':>8} {'path':>6} {'call us':>9} {'dev us':>9} {'GB/s':>7} {'memset us':>10} "
                      f"{'GB/s':>7} {'vs memset':>9} {'per-run call us':>15} {'per-run dev us':>14}")
            else:
                print(f"\n{name} ({args.kv_layout}), {pool.num_blocks} blocks, host shared memory")
                print(f"{'ids':>10} {'n':>5} {'MiB':>8} {'call us':>9} {'GB/s':>7} {'memset us':>10} {'GB/s':>7} "
                      f"{'vs memset':>9}")
            pool.zero_blocks(np.arange(pool.num_blocks, dtype=np.int32))  # first touch of every page, untimed
            for n in COUNTS:
                if n > pool.num_blocks // 2:
                    print(f"{'':>10} {n:>5} skipped: more than half the pool's {pool.num_blocks} blocks")
                    continue
                for pattern in ("scattered", "contiguous"):
                    sets = id_sets(pool.num_blocks, n, pattern, rng)
                    row = (bench_gpu if gpu else bench_host)(pool, n, sets, calls)
                    ratio = row["memset_us"] / row.get("dev_us", row["call_us"])
                    mib = n * layout.block_bytes / (1 << 20)
                    if gpu:
                        print(f"{pattern:>10} {n:>5} {mib:>8.2f} {row['path']:>6} {row['call_us']:>9.1f} "
                              f"{row['dev_us']:>9.2f} "
                              f"{row['gbps']:>7.0f} {row['memset_us']:>10.2f} {row['memset_gbps']:>7.0f} "
                              f"{ratio:>9.2f} {fmt(row, 'per_run_call_us'):>15} {fmt(row, 'per_run_dev_us', 2):>14}")
                    else:
                        print(f"{pattern:>10} {n:>5} {mib:>8.2f} {row['call_us']:>9.1f} {row['gbps']:>7.1f} "
                              f"{row['memset_us']:>10.1f} {row['memset_gbps']:>7.1f} {ratio:>9.2f}")
                    results.append({"layout": name, "kv_layout": args.kv_layout, "backend": args.backend,
                                    "ids": pattern, "n": n, "bytes": n * layout.block_bytes, **row})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
