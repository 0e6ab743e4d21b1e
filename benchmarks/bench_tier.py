#!/usr/bin/env python3
"""The host tier (issue 23): offload/restore bandwidth against a plain pinned memcpy, and the hit rate it buys.

    python benchmarks/bench_tier.py                          host backend, small sizes: any machine
    python benchmarks/bench_tier.py --backend gpu            the H200: Llama-3-8B layout (2 MiB blocks)
    python benchmarks/bench_tier.py --sections hitrate       the core alone: token hit rate with / without the tier

``copies``: for batches of 64, 256 and 1,024 blocks, ``tier.offload_blocks(pairs)`` (pool -> host slots) and
``tier.restore_blocks(pairs)`` (host slots -> pool), with the blocks either *contiguous* (one run: one copy
block-major) or *scattered* (every other block: one copy per block), both block orders. Columns: ``GB/s`` of the
call (wall, submission and completion included), ``memcpy GB/s`` of one plain pinned ``cudaMemcpyAsync`` of the
same bytes in the same direction (host backend: one NumPy copy), ``ratio`` (ours / memcpy; the target is >= 0.8),
and ``submit us/1k``: the CPU time of the call per 1,000 blocks (``time.thread_time``; on the GPU it includes the
wait on the completion event). Medians of ``--repeats`` calls.

``append``: the decode step's latency (AppendToken of ``--decode-seqs`` sequences, one token each, in-process
through the service) while another thread churns prompts with token ids through the same pool, so that cached
blocks are evicted all the time: with the host tier (offloads and write-backs running flat out) against the same
churn without it. p50 / p99 of each; the target is p99 with the tier <= 1.1x without. ``--churn-prompts N``: the
churn cycles over N prompts (recurring: they come back from the tier, so restores run beside the offloads; 0, the
default: every prompt is new). Beside them, for the run with the tier: the guard's lock holds (p99 and max, every
thread's; then the write-back thread's alone), how many write-back blocks an eviction overtook (dropped), and how
many blocks a call copied (offloaded or restored) while holding the lock (the write-back's copies are not counted:
they are queued, or on the host backend copied, with the lock released).

``hitrate``: the core alone (no copies): a shared-prefix workload whose prompts need ``--pressure`` times the pool
(prompts of ``--prompt-blocks`` blocks drawn uniformly from ``--num-prompts``), the token hit rate of a pool of
that size without a tier, with a tier big enough for every prompt, and of a pool big enough for everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "common"), str(ROOT / "client")]

import numpy as np  # noqa: E402

from kvpool.layout import KVLayout  # noqa: E402
from kvpool_server.core import KVCacheManager  # noqa: E402
from kvpool_server.device import create_pool  # noqa: E402
from kvpool_server.offload import restore  # noqa: E402
from kvpool_server.offload.create import create_tier_pool  # noqa: E402
from kvpool_server.offload.host_tier import HostTier, StorePlan  # noqa: E402

LLAMA = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")  # 2 MiB blocks
SMALL = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")  # 32 KiB blocks
BATCHES = (64, 256, 1024)


def memcpy_baseline(pool, tier, n: int, to_host: bool, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds of one plain copy of n blocks' bytes between the pool and the tier's first chunk (median)."""
    nbytes = n * pool.layout.block_bytes
    times = []
    if pool.backend == "gpu":
        import cupy

        chunk = tier.chunks[0].reshape(-1)
        stream = cupy.cuda.Stream(non_blocking=True)
        host, dev = chunk.ctypes.data, pool._base_ptr
        for _ in range(repeats):
            t0 = time.perf_counter()
            if to_host:
                cupy.cuda.runtime.memcpyAsync(host, dev, nbytes, 2, stream.ptr)
            else:
                cupy.cuda.runtime.memcpyAsync(dev, host, nbytes, 1, stream.ptr)
            stream.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    flat = pool.segments.reshape(pool.num_blocks, -1)
    chunk = tier.chunks[0].reshape(tier.chunks[0].shape[0], -1)
    for _ in range(repeats):
        t0 = time.perf_counter()
        if to_host:
            chunk[:n] = flat[:n]
        else:
            flat[:n] = chunk[:n]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_copies(backend: str, layout: KVLayout, repeats: int) -> None:
    num_blocks = 2 * max(BATCHES) + 2
    with create_pool(layout, backend=backend, num_blocks=num_blocks) as pool:
        tier = create_tier_pool(pool, 2 * max(BATCHES), chunk_bytes=2 * max(BATCHES) * layout.block_bytes)
        assert tier.wait_ready(600)
        print(f"\n[{backend} {layout.kv_layout}] block {layout.block_bytes / 2**20:.2f} MiB, pool {num_blocks} blocks")
        print(f"{'batch':>6} {'ids':>11} {'direction':>9} {'GB/s':>8} {'memcpy GB/s':>12} {'ratio':>6} {'submit us/1k':>13}")
        for n in BATCHES:
            for kind in ("contiguous", "scattered"):
                blocks = np.arange(n) if kind == "contiguous" else np.arange(n) * 2
                slots = np.arange(n)
                for to_host in (True, False):
                    pairs = np.stack([blocks, slots] if to_host else [slots, blocks], axis=1).astype(np.int32)
                    call = tier.offload_blocks if to_host else tier.restore_blocks
                    call(pairs)  # warm
                    walls, cpus = [], []
                    for _ in range(repeats):
                        t0, c0 = time.perf_counter(), time.thread_time()
                        call(pairs)
                        cpus.append(time.thread_time() - c0)
                        walls.append(time.perf_counter() - t0)
                    wall = statistics.median(walls)
                    base = memcpy_baseline(pool, tier, n, to_host, repeats)
                    gbs, base_gbs = n * layout.block_bytes / wall / 1e9, n * layout.block_bytes / base / 1e9
                    print(f"{n:>6} {kind:>11} {'D2H' if to_host else 'H2D':>9} {gbs:>8.1f} {base_gbs:>12.1f} "
                          f"{gbs / base_gbs:>6.2f} {statistics.median(cpus) / n * 1e9:>13.0f}")


class TimedLock:
    """The guard's lock, instrumented: how long each hold lasted, and which thread holds it now."""

    def __init__(self, lock) -> None:  # type: ignore[no-untyped-def]
        self.lock, self.owner, self.holds, self.t0 = lock, 0, [], 0.0
        self.writeback_holds: list[float] = []  # those of the tier's write-back thread

    def __enter__(self) -> TimedLock:
        import threading

        self.lock.acquire()
        self.owner, self.t0 = threading.get_ident(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.holds.append(time.perf_counter() - self.t0)
        if threading_name() == "kvpool-tier-writeback":
            self.writeback_holds.append(self.holds[-1])
        self.owner = 0
        self.lock.release()


def threading_name() -> str:
    import threading

    return threading.current_thread().name


def count_locked_copies(memory, lock: TimedLock, counted: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Wrap the tier's copies: ``counted[0]`` += the blocks each copies while its thread holds ``lock``."""
    import threading

    for name in ("offload_blocks", "restore_blocks"):  # a write-back's start_offload only queues its copy (GPU)
        copy = getattr(memory, name)

        def counting(pairs, copy=copy):  # type: ignore[no-untyped-def]
            if lock.owner == threading.get_ident():
                counted[0] += len(pairs)
            return copy(pairs)

        setattr(memory, name, counting)


def churn_prompt(svc, scope, k: int, tokens: int) -> None:  # type: ignore[no-untyped-def]
    """One churned prompt through the service: ``k``'s ``tokens`` token ids registered, prefilled, sealed by one
    more token and freed -- its blocks cached, evictable (into the tier, with one)."""
    prompt = [(k * 7919 + t) % 50_000 for t in range(tokens)]
    with scope.call("RegisterSequence") as call:
        seq, cached, _ = svc.register(call, prompt_token_ids=prompt)
    with scope.call("AppendToken") as call:
        svc.append(call, [seq], [len(prompt) - cached], prompt[cached:])
    with scope.call("AppendToken") as call:
        svc.append(call, [seq], [1], [1])
    with scope.call("Free") as call:
        svc.free(call, [seq])


def append_latency(backend: str, layout: KVLayout, tier_blocks: int,
                   args: argparse.Namespace) -> tuple[float, float, int, int, list[float], int, int, list[float]]:
    """(p50 us, p99 us, blocks offloaded, blocks restored, lock holds s, blocks copied under the lock, write-backs
    overtaken, the write-back thread's lock holds s) of the decode step under churn (see the module docstring)."""
    import threading

    from kvpool_server.config import ServerConfig
    from kvpool_server.service.build import build_service
    from kvpool_server.service.scope import CallScope

    decode_blocks = args.decode_seqs * (args.decode_steps // layout.block_size + 2)
    config = ServerConfig(backend=backend, num_blocks=decode_blocks + 16 * args.prompt_blocks,
                          num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                          block_size=layout.block_size, dtype=layout.dtype, kv_layout=layout.kv_layout,
                          max_seq_len=args.decode_steps + 4 * layout.block_size + args.prompt_blocks * layout.block_size,
                          host_tier_bytes=tier_blocks * layout.block_bytes, max_message_bytes=256 << 20)
    svc, admission = build_service(config)
    scope = CallScope(admission, None, None)
    try:
        lock, copied_locked = TimedLock(svc.guard.lock), [0]
        svc.guard.lock = lock  # type: ignore[assignment]
        if svc.tier is not None:
            assert svc.tier.memory.wait_ready(600)
            svc.tier.stop()  # restarted with the instrumented lock
            svc.tier._stop.clear()
            if config.host_tier_writeback_blocks:
                svc.tier.start_writeback(lock, config.host_tier_writeback_blocks, publish=svc.guard.events.publish)
            count_locked_copies(svc.tier.memory, lock, copied_locked)
        ids = []
        for _ in range(args.decode_seqs):
            with scope.call("RegisterSequence") as call:
                ids.append(svc.register(call).seq_id)
        stop = threading.Event()

        failed: list[BaseException] = []

        def churn() -> None:
            try:
                churn_until_stopped()
            except BaseException as exc:  # the figures mean nothing without the churn: main() re-raises it
                failed.append(exc)
                raise

        def churn_until_stopped() -> None:
            bs, n = layout.block_size, 0
            while not stop.is_set():
                k = n % args.churn_prompts if args.churn_prompts else n
                churn_prompt(svc, scope, k, args.prompt_blocks * bs + 1)
                n += 1

        churner = threading.Thread(target=churn, daemon=True)
        churner.start()
        times = []
        for _ in range(args.decode_steps):
            t0 = time.perf_counter()
            with scope.call("AppendToken") as call:
                svc.append(call, ids, [1])
            times.append(time.perf_counter() - t0)
        stop.set()
        churner.join()
        if failed:
            raise RuntimeError("the churn thread failed") from failed[0]
        with scope.call("Stats") as call:
            stats, _ = svc.stats(call)
        return (float(np.percentile(times, 50)) * 1e6, float(np.percentile(times, 99)) * 1e6,
                stats.host_tier_blocks_offloaded, stats.host_tier_blocks_restored, lock.holds, copied_locked[0],
                stats.host_tier_blocks_torn, lock.writeback_holds)
    finally:
        svc.guard.pool.close()


def bench_append(backend: str, layout: KVLayout, args: argparse.Namespace) -> None:
    print(f"\n[append under churn] {args.decode_seqs} sequences x {args.decode_steps} steps, {backend} pool, "
          f"prompts of {args.prompt_blocks} blocks churned beside them")
    results = {}
    for name, tier_blocks in (("without the tier", 0), ("with the tier", 64 * args.prompt_blocks)):
        results[name] = append_latency(backend, layout, tier_blocks, args)
        p50, p99, offloaded, restored, holds, locked, torn, writeback_holds = results[name]
        print(f"  {name:<17} p50 {p50:8.1f} us   p99 {p99:8.1f} us   blocks offloaded {offloaded}   restored {restored}")
        print(f"  {'':<17} lock holds p99 {np.percentile(holds, 99) * 1e6:8.1f} us   max {max(holds) * 1e6:8.1f} us   "
              f"blocks copied under the lock {locked}   write-backs overtaken {torn}")
        if writeback_holds:
            print(f"  {'':<17} of which the write-back thread's: {len(writeback_holds)}, p99 "
                  f"{np.percentile(writeback_holds, 99) * 1e6:8.1f} us   max {max(writeback_holds) * 1e6:8.1f} us")
    print(f"  p99 with / without: {results['with the tier'][1] / results['without the tier'][1]:.2f} (target <= 1.1)")


def hit_rate(pool_blocks: int, tier_blocks: int, args: argparse.Namespace) -> float:
    bs = 16
    manager = KVCacheManager(pool_blocks, bs, max_seq_len=(args.prompt_blocks + 2) * bs)
    tier = HostTier(manager, tier_blocks) if tier_blocks else None
    rng = np.random.default_rng(0)

    def store(stores: StorePlan) -> None:  # the driver's part, every copy succeeding
        if tier is not None:
            tier.commit(stores.pairs[:, 1].tolist())

    def append(*call_args: Any, **kwargs: Any) -> None:
        plan = manager.append(*call_args, **kwargs)
        if tier is not None:
            store(tier.prepare_store(plan.evicted))

    for i in rng.integers(0, args.num_prompts, size=args.requests).tolist():
        prompt = [(i * 100_003 + t) % 50_000 for t in range(args.prompt_blocks * bs + 1)]
        staged = restore.stage_prompt(tier, None, prompt) if tier is not None else None
        if staged is not None:
            store(staged.stores)
            restore.finish(tier, staged, True)  # type: ignore[arg-type]
        seq = manager.register(prompt_token_ids=prompt)
        cached = manager.num_tokens(seq)
        append(seq, len(prompt) - cached, token_ids=prompt[cached:])
        append(seq, 1, token_ids=[1])
        manager.free(seq)
    return manager.prefix.hit_tokens / manager.prefix.query_tokens


def bench_hit_rate(args: argparse.Namespace) -> None:
    need = args.num_prompts * args.prompt_blocks
    pool = max(args.prompt_blocks + 2, int(need / args.pressure))
    print(f"\n[hit rate] {args.num_prompts} prompts of {args.prompt_blocks} blocks ({need} blocks), {args.requests} "
          f"requests, pool {pool} blocks ({args.pressure:g}x over)")
    rates = {"pool only": hit_rate(pool, 0, args), "pool + host tier": hit_rate(pool, need + 1, args),
             "pool for everything": hit_rate(need + args.prompt_blocks + 2, 0, args)}
    for name, rate in rates.items():
        print(f"  {name:<20} token hit rate {rate:.3f}")
    print(f"  tier / everything: {rates['pool + host tier'] / rates['pool for everything']:.3f} (target >= 0.95)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="host", choices=("host", "gpu"))
    parser.add_argument("--sections", default="copies,append,hitrate")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-blocks", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--pressure", type=float, default=4.0)
    parser.add_argument("--decode-seqs", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=500)
    parser.add_argument("--churn-prompts", type=int, default=0)
    parser.add_argument("--switch-interval", default="",
                        help="append: comma-separated GIL switch intervals in seconds (sys.setswitchinterval), one "
                             "run each (default: Python's, 0.005)")
    args = parser.parse_args()
    layout = LLAMA if args.backend == "gpu" else SMALL
    if "copies" in args.sections:
        for kv_layout in ("block-major", "layer-major"):
            bench_copies(args.backend, dataclasses.replace(layout, kv_layout=kv_layout), args.repeats)
    if "append" in args.sections:
        for interval in [float(x) for x in args.switch_interval.split(",") if x] or [sys.getswitchinterval()]:
            sys.setswitchinterval(interval)
            print(f"\nGIL switch interval {interval * 1e3:g} ms", end="")
            bench_append(args.backend, layout, args)
    if "hitrate" in args.sections:
        bench_hit_rate(args)


if __name__ == "__main__":
    main()
