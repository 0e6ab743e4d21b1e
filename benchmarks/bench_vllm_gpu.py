"""The vLLM connector's CUDA data path on a GPU without vLLM (issue 31): a real kvpool server on the GPU backend,
its pool mapped by CUDA IPC through the connector's own worker (``KVPoolWorker``: ``register_kv_caches``,
``start_load_kv``: its stores, then its loads), vLLM-layout KV tensors of Llama-3-8B (32 layers, 8 KV heads, head size 128,
fp16, block size 16) for a 4,096-token prompt (256 blocks).

vLLM 0.32's CUDA backends see each layer's cache as the logical ``[num_blocks, heads, block_size, 2 x head]``
(K = ``[..., :head]``, V = ``[..., head:]``); FlashAttention's default physical layout is ``LBNHC`` (NHD: memory
order ``[num_blocks, block_size, heads, 2 x head]``, the logical view a permutation of it), FlashInfer's may be
``LBHNC`` (HND: the logical shape contiguous). Both are checked byte for byte against the raw tensor read
independently of the connector's views; the timings use NHD. vLLM is not imported: the few vLLM base classes the
connector's modules import are stubbed when vLLM is absent.

    python3 benchmarks/bench_vllm_gpu.py [--tokens 4096] [--repeats 10]

Exits 1 on any byte mismatch, or when a CUDA copy did not take the Triton kernel (``block_copy.py``, one launch
per direction: the line ``copy path`` says which path ran and, for PyTorch's, why); prints store/load GB/s and
their ratio to ``copy_`` of one contiguous tensor of the same bytes (the issue's bar: >= 0.8x). On a machine
without CUDA it prints "needs CUDA" and exits 0.
"""

from __future__ import annotations

import argparse
import enum
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "common"), str(ROOT / "client")]

LAYERS, HEADS, HEAD, BLOCK, DTYPE = 32, 8, 128, 16, "float16"
DEVICE = "cuda"  # "cpu" with --host-dry-run
ROTATE = 16  # load id arrays taken in turn for "new ids every call"


def stub_vllm() -> None:
    """The names the connector's modules import from vLLM, when vLLM is not installed (the GPU machine)."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401, PLC0415
        import vllm.model_executor.models.utils  # noqa: F401, PLC0415
        return
    except ImportError:
        pass
    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
             "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.distributed.kv_transfer.kv_connector.v1.base",
             "vllm.model_executor", "vllm.model_executor.models", "vllm.model_executor.models.utils"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    base = sys.modules["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    base.KVConnectorBase_V1 = type("KVConnectorBase_V1", (), {})  # type: ignore[attr-defined]
    base.KVConnectorRole = enum.Enum("KVConnectorRole", "SCHEDULER WORKER")  # type: ignore[attr-defined]
    base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})  # type: ignore[attr-defined]
    base.KVConnectorWorkerMetadata = type("KVConnectorWorkerMetadata", (), {})  # type: ignore[attr-defined]
    utils = sys.modules["vllm.model_executor.models.utils"]
    utils.extract_layer_index = lambda name: int(re.findall(r"\.(\d+)\.", name)[0])  # type: ignore[attr-defined]


def start_server(sock: str, num_blocks: int, block_bytes: int, backend: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path[:3] + [os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "kvpool_server", "--backend", backend,
           "--pool-bytes", f"{num_blocks * block_bytes // (1 << 20) + 1}MiB",
           "--num-layers", str(LAYERS), "--num-kv-heads", str(HEADS), "--head-dim", str(HEAD),
           "--block-size", str(BLOCK), "--dtype", DTYPE, "--unix-socket", sock, "--address", "",
           "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, env=env)
    for _ in range(600):
        if os.path.exists(sock):
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"kvpool-server exited with {proc.returncode}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("kvpool-server did not start")


def vllm_caches(torch, num_blocks: int, layout: str) -> tuple[dict, list]:
    """Per-layer caches as vLLM's CUDA backends allocate them: logical [B, H, N, 2D]; ``raws``: the memory order."""
    caches, raws = {}, []
    for layer in range(LAYERS):
        if layout == "NHD":  # LBNHC: memory [B, N, H, 2D], the logical view a permutation
            raw = torch.empty(num_blocks, BLOCK, HEADS, 2 * HEAD, dtype=torch.float16, device=DEVICE)
            logical = raw.permute(0, 2, 1, 3)
        else:  # LBHNC: memory = the logical shape
            raw = torch.empty(num_blocks, HEADS, BLOCK, 2 * HEAD, dtype=torch.float16, device=DEVICE)
            logical = raw
        raw.normal_()  # random fp16 KV, compared as bits
        caches[f"model.layers.{layer}.self_attn.attn"] = logical
        raws.append(raw)
    return caches, raws


def raw_kv(raw, blocks: list, layout: str):
    """K and V of ``blocks`` from the memory-order tensor, [n, block_size, heads, head] each (no connector code)."""
    b = raw[blocks] if layout == "NHD" else raw[blocks].transpose(1, 2)
    return b[..., :HEAD], b[..., HEAD:]


def same(a, b) -> bool:
    import torch  # noqa: PLC0415

    return bool(torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16)))


def sync(torch) -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_s(torch, fn, repeats: int) -> float:
    fn()
    sync(torch)
    times = []
    for _ in range(repeats):
        sync(torch)
        t0 = time.perf_counter()
        fn()
        sync(torch)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run_layout(torch, worker, meta_mod, pid: str, pool_blocks: list, layout: str, repeats: int, timed: bool,
               profile: bool = False) -> bool:
    """One worker for both layouts: the pool is mapped once (a second CUDA IPC open of one handle in a process fails)."""
    n = len(pool_blocks)
    src, dst = list(range(n)), list(range(n + 1, 2 * n + 1))  # dst: other vLLM block ids (block n untouched)
    caches, raws = vllm_caches(torch, 2 * n + 2, layout)
    worker.register_kv_caches(caches)
    # with_pairs: the step's id arrays, as the scheduler's build_connector_meta makes them (not timed: its side)
    save = meta_mod.KVPoolConnectorMetadata(pid, saves=[meta_mod.BlockCopy("r", tuple(pool_blocks), tuple(src))]).with_pairs()
    load = meta_mod.KVPoolConnectorMetadata(pid, loads=[meta_mod.BlockCopy("r", tuple(pool_blocks), tuple(dst))]).with_pairs()
    ok = True
    stored = worker.blocks_stored
    worker.start_load_kv(save)
    sync(torch)
    if worker.worker_meta() is not None or worker.blocks_stored != stored + n:
        print(f"[{layout}] FAILED: the store reported a failure (see the warning above)")
        return False
    paths = {"store": worker.copy_path}
    pool = worker._pool_tensor  # the connector's own view of the mapped pool: [blocks, L, 2, B, H, D]
    pool_ids = torch.tensor(pool_blocks, device=pool.device)
    for layer in range(LAYERS):  # every stored byte, against the raw tensor read without the connector's views
        k, v = raw_kv(raws[layer], src, layout)
        if not (same(pool[pool_ids, layer, 0], k) and same(pool[pool_ids, layer, 1], v)):
            print(f"[{layout}] MISMATCH after store: layer {layer}, kvpool blocks {pool_blocks[:3]}.. != vLLM blocks "
                  f"{src[0]}..")
            ok = False
    untouched = [r[n].clone() for r in raws]
    worker.start_load_kv(load)
    sync(torch)
    paths["load"] = worker.copy_path
    errors = worker.get_block_ids_with_load_errors()
    if errors:
        print(f"[{layout}] FAILED: the load reported {len(errors)} blocks as errors")
        return False
    for layer, raw in enumerate(raws):
        if not same(raw[src], raw[dst]):
            print(f"[{layout}] MISMATCH after load: layer {layer}, vLLM blocks {dst[0]}.. != {src[0]}..")
            ok = False
        if not same(raw[n], untouched[layer]):
            print(f"[{layout}] MISMATCH: layer {layer}, vLLM block {n} (not in the load) was written")
            ok = False
    print(f"[{layout}] bytes {'verified' if ok else 'WRONG'}: {n} blocks x {LAYERS} layers stored into kvpool "
          f"(checked against the raw tensor) and loaded back into other vLLM block ids")
    print(f"[{layout}] copy path: store {paths['store']}, load {paths['load']}")
    copier = worker._copier
    if DEVICE == "cuda" and copier.ids is not None:
        print(f"[{layout}] launch: {'the compiled kernel raw (RawLaunch)' if copier.direct else 'JIT'}, ids up "
              f"through {'the CUDA runtime (CuPy)' if copier.ids._rt is not None else 'PyTorch'}")
    if DEVICE == "cuda" and set(paths.values()) != {"triton"}:
        print(f"[{layout}] FAILED: the CUDA copy did not take the Triton kernel (block_copy.py)")
        ok = False
    if timed and ok:
        nbytes = n * model_block_bytes()
        a = torch.empty(nbytes // 2, dtype=torch.float16, device=DEVICE)
        b = torch.empty_like(a)
        t_store = median_s(torch, lambda: worker.start_load_kv(save), repeats)
        t_load = median_s(torch, lambda: worker.start_load_kv(load), repeats)
        t_copy = median_s(torch, lambda: b.copy_(a), repeats)
        fresh = fresh_loads(torch, meta_mod, pid, pool_blocks, dst, ROTATE)
        turn = iter(range(1 << 30))
        t_fresh = median_s(torch, lambda: worker.start_load_kv(fresh[next(turn) % ROTATE]), repeats)
        host = host_us(torch, lambda: worker.start_load_kv(fresh[next(turn) % ROTATE]), max(repeats, 50))
        t_stream = back_to_back_s(torch, lambda: worker.start_load_kv(fresh[next(turn) % ROTATE]), repeats)
        t_copy_stream = back_to_back_s(torch, lambda: b.copy_(a), repeats)
        for raw in raws:  # the timed loads' bytes too (launched directly, not through Triton's JIT): from zero
            raw[dst] = 0
        worker.start_load_kv(fresh[0])
        sync(torch)
        if not all(same(raw[src], raw[dst]) for raw in raws):
            print(f"[{layout}] MISMATCH after the timed loads (new ids): vLLM blocks {dst[0]}.. != {src[0]}..")
            ok = False
        if worker.get_block_ids_with_load_errors() or worker.worker_meta() is not None:
            print(f"[{layout}] FAILED: a timed copy reported a failure")
            ok = False
        gbs = nbytes / 1e9
        print(f"\n{n} blocks ({n * BLOCK} tokens), {nbytes / (1 << 20):.0f} MiB, median of {repeats}, "
              f"Llama-3-8B layout, vLLM {layout}:")
        print(f"  device memcpy (copy_)         {t_copy * 1e3:8.3f} ms  {gbs / t_copy:7.1f} GB/s  1.00x")
        for name, t in (("store vLLM -> kvpool", t_store), ("load  kvpool -> vLLM", t_load)):
            ratio = t_copy / t
            print(f"  {name:29s} {t * 1e3:8.3f} ms  {gbs / t:7.1f} GB/s  {ratio:.2f}x "
                  f"({'meets' if ratio >= 0.8 else 'BELOW'} the 0.8x bar)")
        print(f"  load, new ids every call      {t_fresh * 1e3:8.3f} ms  {gbs / t_fresh:7.1f} GB/s  {t_copy / t_fresh:.2f}x"
              f" ({ROTATE} id arrays in turn)")
        print(f"  load, new ids, back to back   {t_stream * 1e3:8.3f} ms  {gbs / t_stream:7.1f} GB/s  "
              f"{t_copy_stream / t_stream:.2f}x of copy_ back to back ({t_copy_stream * 1e3:.3f} ms): the device's time, "
              "the host's work overlapped")
        print(f"  the load's host time (start_load_kv's return, new ids): median {host:.1f} us")
        if profile:
            profile_loads(torch, worker, fresh)
    return ok


def fresh_loads(torch, meta_mod, pid: str, pool_blocks: list, dst: list, count: int) -> list:
    """``count`` loads of the same blocks into ``dst`` in different orders: each call's ids differ from the last,
    as in serving, where every step copies other blocks."""
    loads = []
    for k in range(count):
        order = torch.randperm(len(dst), generator=torch.Generator().manual_seed(k)).tolist()
        loads.append(meta_mod.KVPoolConnectorMetadata(pid, loads=[meta_mod.BlockCopy(
            "r", tuple(pool_blocks[i] for i in order), tuple(dst[i] for i in order))]).with_pairs())
    return loads


def host_us(torch, fn, repeats: int) -> float:
    """The median time ``fn`` takes to return (the host's work and the launch, not the copy), the device idle before."""
    fn()
    times = []
    for _ in range(repeats):
        sync(torch)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sync(torch)
    return sorted(times)[len(times) // 2] * 1e6


def back_to_back_s(torch, fn, repeats: int) -> float:
    """The mean time of ``fn`` called ``repeats`` times without a sync between (CUDA events around the lot): the
    device's time per call wherever the host's work is shorter than the copy."""
    fn()
    sync(torch)
    if DEVICE != "cuda":
        return median_s(torch, fn, repeats)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def profile_loads(torch, worker, loads: list, calls: int = 400) -> None:
    """cProfile of ``calls`` loads (new ids each): where the host's time of a worker call goes."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    prof = cProfile.Profile()
    for i in range(calls):
        sync(torch)
        prof.enable()
        worker.start_load_kv(loads[i % len(loads)])
        prof.disable()
    sync(torch)
    print(f"\ncProfile of {calls} loads (host time only, the device idle before each), by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def model_block_bytes() -> int:
    return LAYERS * 2 * BLOCK * HEADS * HEAD * 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="also a cProfile of the worker's loads (host time)")
    parser.add_argument("--jit-launch", action="store_true", help="every copy through Triton's JIT (CopyConfig."
                        "direct_launch off): the launch's host cost against the direct launch")
    parser.add_argument("--host-dry-run", action="store_true", help="a check of this script without a GPU: a host "
                        "pool, CPU tensors read through the CUDA branch of kv_views (not the CUDA path itself)")
    args = parser.parse_args()
    global DEVICE
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        print("needs CUDA (torch is not installed)")
        return 0
    if not torch.cuda.is_available() and not args.host_dry_run:
        print("needs CUDA")
        return 0
    DEVICE = "cpu" if args.host_dry_run else "cuda"
    stub_vllm()
    from kvpool_client import KVPoolClient  # noqa: PLC0415
    from kvpool_client.integrations.vllm import metadata as meta_mod  # noqa: PLC0415
    from kvpool_client.integrations.vllm import worker as vw  # noqa: PLC0415
    from kvpool_client.integrations.vllm.link import pool_id  # noqa: PLC0415
    from kvpool_client.integrations.vllm.settings import ConnectorSettings, ModelLayout  # noqa: PLC0415

    if args.jit_launch:
        from dataclasses import replace  # noqa: PLC0415

        from kvpool_client.integrations.vllm import block_copy  # noqa: PLC0415

        block_copy.DEFAULT = replace(block_copy.DEFAULT, direct_launch=False)
        print(f"copy config: {block_copy.DEFAULT.label()}")

    if args.host_dry_run:  # the CPU backend's branch reads another layout: take the CUDA backends' on CPU tensors
        def cuda_kv_views(cache, block_size):
            d = cache.shape[3] // 2
            return cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2)
        vw.kv_views = cuda_kv_views
    n = -(-args.tokens // BLOCK)
    tmp = tempfile.mkdtemp(prefix="kvpool-vllm-gpu-")
    sock = f"{tmp}/kvpool.sock"
    proc = start_server(sock, n + 8, model_block_bytes(), "host" if args.host_dry_run else "gpu")
    try:
        settings = ConnectorSettings(f"unix:{sock}", timeout_s=10.0)
        model = ModelLayout(LAYERS, HEADS, HEAD, BLOCK, DTYPE)
        with KVPoolClient(settings.target, session=False) as client:  # the scheduler side's view of the pool
            description = client.describe_pool()
        model.check_pool(description.layout, settings.target)
        pid = pool_id(description)
        if description.num_blocks < n:
            raise RuntimeError(f"the pool has {description.num_blocks} blocks, the prompt needs {n}")
        where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run)"
        print(f"kvpool pool {pid}: {description.num_blocks} blocks, {where}")
        # kvpool blocks in a shuffled order (not 0..n-1): a wrong index shows as a mismatch
        pool_blocks = torch.randperm(description.num_blocks)[:n].tolist()
        worker = vw.KVPoolWorker(settings, model)  # the connector's worker side, as vLLM builds it
        ok = run_layout(torch, worker, meta_mod, pid, pool_blocks, "HND", args.repeats, timed=False)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        ok = run_layout(torch, worker, meta_mod, pid, pool_blocks, "NHD", args.repeats, timed=True,
                        profile=args.profile) and ok
        worker.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print("result:", "OK" if ok else "FAILED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
