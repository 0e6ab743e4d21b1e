#!/usr/bin/env python3
"""One batch for the GPU machine: device + core tests with the GPU backend, then the copy_blocks benchmark.

    PYTHONUNBUFFERED=1 python3 scripts/gpu_device_check.py 2>&1 | tee $OUT/gpu_device_check.log

1. ``pytest -q tests/device tests/core`` with KVPOOL_TEST_BACKEND=gpu (GPU cases must run, not skip). The GPU
   image lacks grpcio-health-checking, which ``kvpool_client`` and tests/conftest.py import: the run carries its
   wheel (scripts/gpu_device_check.sh).
2. the server's copy_blocks kernel and the variants of scripts/copy_kernel_variants.py vs ``cudaMemcpyAsync`` of
   one contiguous span of the same bytes, vs fancy indexing, for 1024 and 4096 blocks of 64 KiB and 256 KiB.
   Random data, random (src, dst) sets rotated over a 4 GiB pool (sources in one half, destinations in the other,
   so the L2 holds none of it), warm-up, CUDA events around batches of launches, median of batches. Bandwidth
   counts bytes read + written. After each kernel's timed launches the whole destination half is checked against
   the last writer of every block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(ROOT / "server"), str(ROOT / "common"), str(ROOT / "client")]
sys.path[:0] = PATHS

import cupy  # noqa: E402
import numpy as np  # noqa: E402

from kvpool.layout import KVLayout  # noqa: E402
from kvpool_server.device.copy_kernel import THREADS, UNROLL, BlockCopier  # noqa: E402
from kvpool_server.device.gpu_pool import GpuPool  # noqa: E402

from copy_kernel_variants import VARIANTS, VariantCopier  # noqa: E402  (this directory)

SERVER = "server"  # the server's own BlockCopier, timed and checked beside the variants
# 64 KiB and 256 KiB blocks of realistic layouts: 16 tokens x (L layers x K,V x 4 heads x 128 x fp16)
LAYOUTS = {64: KVLayout(2, 4, 128, 16, "float16"), 256: KVLayout(8, 4, 128, 16, "float16")}
COUNTS = (1024, 4096)
HALF_BYTES = 2 << 30
NUM_SETS, BATCH, NUM_BATCHES = 8, 20, 15
OUT = Path(os.environ.get("OUT", "/tmp"))


def run_tests() -> int:
    pythonpath = os.pathsep.join([*PATHS, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, KVPOOL_TEST_BACKEND="gpu", PYTHONPATH=pythonpath)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/device", "tests/core"]
    print("$ KVPOOL_TEST_BACKEND=gpu pytest", " ".join(cmd[4:]), flush=True)
    t0 = time.time()
    rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=240).returncode
    print(f"  ({time.time() - t0:.1f} s)", flush=True)
    return rc


def fill_random(flat_u8: cupy.ndarray, seed: int) -> None:
    rng = cupy.random.default_rng(seed)
    as_f64 = flat_u8.view(cupy.float64)
    step = 32 << 20
    for i in range(0, as_f64.size, step):
        n = min(step, as_f64.size - i)
        as_f64[i : i + n] = rng.random(n, dtype=cupy.float64) + 1.0  # random mantissas: no block is all zeros


def timed(launch, stream: cupy.cuda.Stream, num_batches: int = NUM_BATCHES, batch: int = BATCH) -> float:
    """Median over batches of the mean time per launch, in seconds. ``launch(i)`` enqueues launch number i."""
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    i = 0
    for _ in range(3):  # warm-up
        launch(i)
        i += 1
    times = []
    for _ in range(num_batches):
        start.record(stream)
        for _ in range(batch):
            launch(i)
            i += 1
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3 / batch)
    return float(np.median(times))


def bench_size(kib: int) -> list[dict]:
    layout = LAYOUTS[kib]
    bb = layout.block_bytes
    assert bb == kib << 10
    half = max(max(COUNTS), HALF_BYTES // bb)
    rows_out = []
    with GpuPool(layout, 2 * half, staging_bytes=1 << 20) as pool:
        stream = pool._stream
        base = pool._base_ptr
        flat = pool.blocks.reshape(-1).view(cupy.uint8)
        rows = flat.view(cupy.uint64).reshape(2 * half, bb // 8)
        fill_random(flat, kib)
        rng = np.random.default_rng(kib)
        snapshot = cupy.empty((half, bb // 8), dtype=cupy.uint64)
        for count in COUNTS:
            sets = []
            for _ in range(NUM_SETS):
                src = rng.permutation(half)[:count]
                dst = half + rng.permutation(half)[:count]
                sets.append((src, dst, cupy.asarray(np.stack([src, dst], 1).astype(np.int32).reshape(-1))))
            moved = 2 * count * bb
            results = {}

            spans = [(int(rng.integers(0, half - count)), int(rng.integers(0, half - count))) for _ in range(NUM_SETS)]

            def memcpy(i: int) -> None:
                s, d = spans[i % NUM_SETS]
                cupy.cuda.runtime.memcpyAsync(base + (half + d) * bb, base + s * bb, count * bb, 3, stream.ptr)

            results["memcpy"] = timed(memcpy, stream)
            copiers = {SERVER: BlockCopier(bb), **{name: VariantCopier(bb, cfg) for name, cfg in VARIANTS.items()}}
            for name, copier in copiers.items():
                snapshot[...] = rows[half:]
                last_src = np.full(half, -1, dtype=np.int64)
                order = []

                def launch(i: int) -> None:
                    order.append(i % NUM_SETS)
                    copier.launch(base, sets[i % NUM_SETS][2].data.ptr, count, stream)

                results[name] = timed(launch, stream)
                for k in order:
                    last_src[sets[k][1] - half] = sets[k][0]
                ok = check(rows, snapshot, last_src, half)
                results[name + ":ok"] = ok
                results[name + ":regs"] = (copier._kernel.num_regs, copier._kernel.local_size_bytes)

            dev_sets = [(cupy.asarray(s), cupy.asarray(d)) for s, d, _ in sets]

            def fancy(i: int) -> None:
                s, d = dev_sets[i % NUM_SETS]
                with stream:
                    rows[d] = rows[s]

            results["fancy"] = timed(fancy, stream, num_batches=5, batch=4)
            host_pairs = [np.stack([s, d], 1).astype(np.int32) for s, d, _ in sets]
            stages = {"wall: validate": pool._checked_copies, "wall: _copy (upload+launch+sync)": pool._copy,
                      "wall: pool.copy_blocks": pool.copy_blocks}
            for stage, fn in stages.items():
                results[stage] = wall_median(lambda i: fn(host_pairs[i % NUM_SETS]))
            mc = results["memcpy"]
            for name in ["memcpy", *copiers, "fancy", *stages]:
                t = results[name]
                rows_out.append(dict(block_kib=kib, copies=count, method=name, us=t * 1e6, tbps=moved / t / 1e12,
                                     ratio=mc / t, ok=results.get(name + ":ok"), regs=results.get(name + ":regs")))
    return rows_out


def wall_median(call, n: int = 30, skip: int = 5) -> float:
    walls = []
    for i in range(n):
        t0 = time.perf_counter()
        call(i)
        walls.append(time.perf_counter() - t0)
    return float(np.median(walls[skip:]))


def bench_small_and_slots() -> None:
    """Latency of small copy batches through pool.copy_blocks, and write_slots/read_slots throughput."""
    layout = LAYOUTS[64]
    rng = np.random.default_rng(0)
    with GpuPool(layout, 8192) as pool:
        fill_random(pool.blocks.reshape(-1).view(cupy.uint8), 1)
        print(f"\nsmall batches, 64 KiB blocks, the server's kernel ({THREADS} threads x {UNROLL} vectors)")
        print(f"{'copies':>6} {'kernel us (back-to-back)':>25} {'copy_blocks wall us':>20}")
        for c in (1, 16, 128, 1024):
            host = [np.stack([perm[:c], perm[c : 2 * c]], 1).astype(np.int32) for perm in
                    (rng.permutation(8192) for _ in range(NUM_SETS))]
            with pool._stream:  # upload on the pool's stream, then wait: the kernel below reads these pairs
                dev = [cupy.asarray(h.reshape(-1)) for h in host]
            pool._stream.synchronize()
            kernel = timed(lambda i: pool.copier.launch(pool._base_ptr, dev[i % NUM_SETS].data.ptr, c, pool._stream),
                           pool._stream)
            wall = wall_median(lambda i: pool.copy_blocks(host[i % NUM_SETS]), n=60, skip=10)
            print(f"{c:>6} {kernel * 1e6:25.1f} {wall * 1e6:20.1f}")
        print(f"\nwrite_slots / read_slots, token {layout.token_bytes} B, staging {pool.staging_tokens} tokens")
        for n in (4096, 65536):
            slots = rng.permutation(pool.num_slots)[:n]
            data = rng.integers(1, 256, n * layout.token_bytes, dtype=np.uint8).view(layout.storage_dtype)
            data = data.reshape(n, *layout.token_shape)
            w = wall_median(lambda i: pool.write_slots(slots, data), n=6, skip=1)
            r = wall_median(lambda i: pool.read_slots(slots), n=6, skip=1)
            same = np.array_equal(pool.read_slots(slots).view(np.uint8), data.view(np.uint8))
            gb = n * layout.token_bytes / 1e9
            print(f"  n={n:>6}: write {w * 1e3:7.2f} ms ({gb / w:5.2f} GB/s)  read {r * 1e3:7.2f} ms "
                  f"({gb / r:5.2f} GB/s)  roundtrip equal: {same}")


def check(rows: cupy.ndarray, snapshot: cupy.ndarray, last_src: np.ndarray, half: int) -> bool:
    """Every destination block holds its last writer's source; blocks never written hold their old bytes."""
    step = 1024
    for i in range(0, half, step):
        idx = np.arange(i, min(i + step, half))
        expected = snapshot[i : i + len(idx)].copy()
        written = last_src[idx] >= 0
        if written.any():
            expected[cupy.asarray(np.nonzero(written)[0])] = rows[cupy.asarray(last_src[idx][written])]
        if not bool((rows[half + i : half + i + len(idx)] == expected).all()):
            return False
    return True


def main() -> int:
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    print(f"device {props['name'].decode()} sm_{props['major']}{props['minor']} {props['multiProcessorCount']} SMs, "
          f"CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
          f"driver {cupy.cuda.runtime.driverGetVersion()}, NumPy {np.__version__}, Python {sys.version.split()[0]}")
    print(f"the server's copy kernel: {THREADS} threads x {UNROLL} 16-byte vectors, plain loads", flush=True)
    rc = run_tests()
    print(f"tests rc={rc}", flush=True)

    table = []
    for kib in LAYOUTS:
        table += bench_size(kib)
    bench_small_and_slots()
    (OUT / "bench.json").write_text(json.dumps(table, indent=1))
    print(f"\n{'block':>6} {'copies':>6}  {'method':<34} {'us':>9} {'TB/s':>6} {'vs memcpy':>9}  ok   regs/local")
    for r in table:
        ok = "" if r["ok"] is None else ("yes" if r["ok"] else "NO")
        regs = "" if r["regs"] is None else f"{r['regs'][0]}/{r['regs'][1]}"
        print(f"{r['block_kib']:>4}Ki {r['copies']:>6}  {r['method']:<34} {r['us']:9.1f} {r['tbps']:6.2f} "
              f"{r['ratio']:8.1%}  {ok:<4} {regs}")
    scores = {name: min(r["ratio"] for r in table if r["method"] == name) for name in VARIANTS}
    best = max(scores, key=scores.get)
    print("\nworst-case ratio to memcpy per variant:", {k: round(v, 3) for k, v in scores.items()})
    print(f"best variant: {best} {VARIANTS[best]} (worst case {scores[best]:.1%}); the server's kernel: worst case "
          f"{min(r['ratio'] for r in table if r['method'] == SERVER):.1%}")
    all_ok = all(r["ok"] in (None, True) for r in table)
    print(f"copy results correct: {all_ok}; tests rc={rc}")
    return 0 if rc == 0 and all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
