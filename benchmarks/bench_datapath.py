#!/usr/bin/env python3
"""The client data path on a GPU pool, with a real model's layout, against a device memcpy of the same bytes.

    python3 benchmarks/bench_datapath.py --json $OUT/datapath.json      (needs a GPU, CuPy, PyTorch, Triton)

Starts a kvpool server on the GPU backend (Llama-3-8B's KV layout: 32 layers, 8 KV heads, head_dim 128, fp16,
16-token blocks = 128 KiB a token, 2 MiB a block), attaches to it by CUDA IPC like any client, and times:

1. whole-token write/read (``write_slots`` / ``read_slots(out=)``) of n tokens to random slots, device slots;
2. per-layer write (``write_layer``) of n tokens' K and V, n = 1, 16, 256;
3. the old path (CuPy fancy indexing, as ``write_slots`` did before) for scale;
4. paged decode attention (Triton) over 256 sequences x 2048 tokens of layer 0, against PyTorch SDPA on dense K/V,
   and PyTorch's FlexAttention (compiled) reading the same pool K/V through the block tables (``flex_paged``);
5. the server's copy-on-write kernel (``BlockCopier``, in this process on a fresh ``GpuPool`` after the server has
   gone) copying c random blocks, against a memcpy of the same bytes.

``--kv-layout layer-major`` runs it all on a layer-major pool; ``--quick`` skips the latency loops and n=4096.

Device time: each move is captured 20 times into a CUDA graph (rotating over input sets larger than the L2), the
graph replayed, CUDA events around the replays, median of 15; memcpy (``cudaMemcpyAsync`` D2D of the same bytes,
same rotation) is timed the same way in the same run. Bandwidth = bytes read + bytes written. Latency: wall time
of one call plus a stream synchronize, median of 200. Attention: ``triton.testing.do_bench`` medians; its
effective bandwidth counts the K/V bytes it must read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "common"), str(ROOT / "client")]

import cupy  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_client.kernels import torch_views  # noqa: E402
from kvpool_client.kernels.paged_attention import paged_decode_attention  # noqa: E402

L2_BYTES = 64 << 20
GRAPH_CALLS, REPEATS = 20, 15


def start_server(pool_gib: int, kv_layout: str = "block-major") -> tuple[subprocess.Popen, str]:
    port_file = Path("/tmp/kvpool_bench_port")
    port_file.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path[:3] + [os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "kvpool_server", "--backend", "gpu", "--pool-bytes",
                             f"{pool_gib}GiB", "--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128",
                             "--block-size", "16", "--dtype", "float16", "--address", "127.0.0.1:0", "--port-file",
                             str(port_file), "--kv-layout", kv_layout], env=env)
    for _ in range(600):
        if port_file.exists() and port_file.read_text().strip():
            return proc, f"127.0.0.1:{port_file.read_text().strip()}"
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not start")


def graph_time(enqueue, num_sets: int, stream: cupy.cuda.Stream) -> float:
    """Seconds per call: GRAPH_CALLS calls (call i on input set i % num_sets) captured in a graph, replayed."""
    for i in range(num_sets):  # warm-up, compiles kernels outside the capture
        enqueue(i, stream)
    stream.synchronize()
    stream.begin_capture()
    for i in range(GRAPH_CALLS):
        enqueue(i % num_sets, stream)
    graph = stream.end_capture()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(REPEATS):
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3 / GRAPH_CALLS)
    return statistics.median(times)


def memcpy_time(nbytes: int, stream: cupy.cuda.Stream) -> float:
    sets = max(2, -(-4 * L2_BYTES // max(nbytes, 1)))
    src = [cupy.cuda.alloc(nbytes) for _ in range(min(sets, 64))]
    dst = [cupy.cuda.alloc(nbytes) for _ in range(min(sets, 64))]

    def enqueue(i, s):
        cupy.cuda.runtime.memcpyAsync(dst[i].ptr, src[i].ptr, nbytes, 3, s.ptr)

    return graph_time(enqueue, len(src), stream)


def latency(call, stream: cupy.cuda.Stream, n: int = 200) -> float:
    for _ in range(10):
        call()
    stream.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        stream.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_moves(pool, rows: list, results: dict, quick: bool = False) -> None:
    layout = pool.layout
    tb = layout.token_bytes
    num_slots = pool.num_blocks * layout.block_size
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    for n in (256, 1024) if quick else (64, 256, 1024, 4096):
        nbytes = n * tb
        sets = max(2, min(16, -(-4 * L2_BYTES // nbytes)))
        slots = [cupy.asarray(rng.choice(num_slots, n, replace=False)) for _ in range(sets)]
        data = [cupy.random.standard_normal((n, *layout.token_shape), dtype=cupy.float32).astype(cupy.float16)
                for _ in range(sets)]
        w = graph_time(lambda i, s: pool.write_slots(slots[i], data[i], stream=s), sets, stream)
        r = graph_time(lambda i, s: pool.read_slots(slots[i], out=data[i], stream=s), sets, stream)
        m = memcpy_time(nbytes, stream)
        for name, t in (("write_slots", w), ("read_slots", r)):
            rows.append((f"{name} n={n}", nbytes, t, m))
        results[f"tokens_{n}"] = {"bytes": nbytes, "write_s": w, "read_s": r, "memcpy_s": m}
        if n == 256 and not quick:  # the old path, for scale: fancy indexing (what write_slots did before)
            block_ids, offsets = slots[0] // 16, slots[0] % 16
            with stream:
                for _ in range(3):
                    pool.blocks[block_ids, :, :, offsets] = data[0]
                stream.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    pool.blocks[block_ids, :, :, offsets] = data[0]
                stream.synchronize()
            old = (time.perf_counter() - t0) / 10
            rows.append(("fancy-index write n=256 (old)", nbytes, old, m))
            results["fancy_index_256_s"] = old
    row_bytes = layout.num_kv_heads * layout.head_dim * layout.itemsize
    for n in (1, 16, 256):
        nbytes = 2 * n * row_bytes
        sets = 16
        slots = [cupy.asarray(rng.choice(num_slots, n, replace=False)) for _ in range(sets)]
        kv = [cupy.random.standard_normal((2, n, 8, 128), dtype=cupy.float32).astype(cupy.float16)
              for _ in range(sets)]
        layers = rng.integers(0, 32, sets)
        t = graph_time(lambda i, s: pool.write_layer(int(layers[i]), slots[i], kv[i][0], kv[i][1], stream=s), sets,
                       stream)
        m = memcpy_time(nbytes, stream)
        rows.append((f"write_layer n={n}", nbytes, t, m))
        if quick:
            results[f"layer_{n}"] = {"bytes": nbytes, "write_s": t, "memcpy_s": m}
            continue
        lat = latency(lambda: pool.write_layer(3, slots[0], kv[0][0], kv[0][1], stream=stream), stream)
        ts = torch.from_numpy(cupy.asnumpy(slots[0])).cuda()
        tk = torch.randn(n, 8, 128, device="cuda", dtype=torch.float16)
        tstream = torch.cuda.Stream()
        cs = cupy.cuda.ExternalStream(tstream.cuda_stream)
        lat_torch = latency(lambda: pool.write_layer(3, ts, tk, tk, stream=tstream), cs)
        results[f"layer_{n}"] = {"bytes": nbytes, "write_s": t, "memcpy_s": m, "latency_s": lat,
                                 "latency_torch_s": lat_torch}
        print(f"write_layer n={n}: call + sync {lat * 1e6:.1f} us (CuPy), {lat_torch * 1e6:.1f} us (torch tensors)")
    pool.check_slot_errors()


def bench_attention(pool, results: dict, rows: list, quick: bool = False) -> None:
    batch, seq_len, hq, hkv, d, bs = 256, 2048, 32, 8, 128, 16
    whole = torch_views.blocks(pool)
    k_cache, v_cache = whole[:, 0, 0], whole[:, 0, 1]
    k_cache.normal_()
    v_cache.normal_()
    per_seq = seq_len // bs
    perm = torch.randperm(pool.num_blocks, device="cuda")[: batch * per_seq]
    tables = perm.view(batch, per_seq).int().contiguous()
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.float16)
    kv_bytes = 2 * batch * seq_len * hkv * d * 2
    # dense K/V of the same tokens (the SDPA baseline and the check)
    k_dense = k_cache[tables.long()].reshape(batch, seq_len, hkv, d).transpose(1, 2).contiguous()
    v_dense = v_cache[tables.long()].reshape(batch, seq_len, hkv, d).transpose(1, 2).contiguous()
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, enable_gqa=True)[:, :, 0]
    copy_src = torch.empty(kv_bytes // 2, dtype=torch.float16, device="cuda").normal_()
    copy_dst = torch.empty_like(copy_src)
    t_copy = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), warmup=50, rep=300, return_mode="median")
    t_sdpa = triton.testing.do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, enable_gqa=True),
        warmup=50, rep=300, return_mode="median")
    memcpy_bw = 2 * kv_bytes / (t_copy / 1e3)
    results["attention"] = {"kv_bytes": kv_bytes, "memcpy_ms": t_copy, "memcpy_bw": memcpy_bw, "sdpa_ms": t_sdpa,
                            "configs": {}}
    best = None
    configs = [(64, 4, 2), (128, 4, 3)] if quick else [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2),
                                                        (128, 4, 3)]
    for block_n, warps, stages in configs:
        def run(bn=block_n, w=warps, st=stages):
            return paged_decode_attention(q, k_cache, v_cache, tables, lens, block_n=bn, num_warps=w, num_stages=st)
        try:
            out = run()
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            t = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
        except Exception as e:  # noqa: BLE001  (a config that does not compile is reported, not fatal)
            print(f"config {block_n}/{warps}/{stages} failed: {e!r}"[:300])
            continue
        bw = kv_bytes / (t / 1e3)
        results["attention"]["configs"][f"n{block_n}w{warps}s{stages}"] = {"ms": t, "bw": bw, "rel_err": err}
        print(f"paged decode BLOCK_N={block_n} warps={warps} stages={stages}: {t:.3f} ms, {bw / 1e12:.2f} TB/s, "
              f"{bw / memcpy_bw:.2f}x memcpy, rel err vs SDPA {err:.1e}")
        if best is None or t < best[0]:
            best = (t, f"paged decode n{block_n}w{warps}s{stages}", err)
    t_b, name, err = best
    rows.append((name + f" (err {err:.0e})", kv_bytes, t_b / 1e3, kv_bytes / memcpy_bw))
    rows.append(("SDPA dense (same K/V)", kv_bytes, t_sdpa / 1e3, kv_bytes / memcpy_bw))
    try:  # FlexAttention on the pool's own K/V: block tables -> block mask (made once, timed apart)
        from kvpool_client.kernels.flex_paged import flex_paged_attention, paged_block_mask, token_rows

        k_rows, per_block = token_rows(k_cache)
    except Exception as e:  # noqa: BLE001
        print(f"flex unavailable: {e!r}", flush=True)
        per_block = None
    for kv_tile in (16, 128) if per_block else ():
        try:
            t0 = time.perf_counter()
            mask = paged_block_mask(tables, lens, 1, num_blocks=pool.num_blocks, block_size=bs,
                                    per_block=per_block, rows=k_rows.shape[2], kv_tile=kv_tile)
            torch.cuda.synchronize()
            t_mask = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = flex_paged_attention(q, k_cache, v_cache, tables, lens, block_mask=mask)
            torch.cuda.synchronize()
            t_compile = time.perf_counter() - t0
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            t_flex = triton.testing.do_bench(lambda m=mask: flex_paged_attention(q, k_cache, v_cache, tables, lens,
                                                                                 block_mask=m),
                                             warmup=50, rep=300, return_mode="median")
            results["attention"][f"flex_tile{kv_tile}"] = {"ms": t_flex, "rel_err": err, "mask_s": t_mask,
                                                           "first_call_s": t_compile, "rows_per_block": per_block}
            rows.append((f"FlexAttention, KV tile {kv_tile} (err {err:.0e})", kv_bytes, t_flex / 1e3,
                         kv_bytes / memcpy_bw))
            print(f"flex paged decode, KV tile {kv_tile}: {t_flex:.3f} ms, {kv_bytes / (t_flex / 1e3) / 1e12:.2f} "
                  f"TB/s, rel err vs SDPA {err:.1e}; block mask {t_mask * 1e3:.1f} ms, first call (compile) "
                  f"{t_compile:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001  (reported, not fatal: the rest of the benchmark still runs)
            print(f"flex paged decode, KV tile {kv_tile}, failed: {e!r}"[:1500], flush=True)
            results["attention"][f"flex_tile{kv_tile}_error"] = repr(e)[:1500]
    print(f"attention: memcpy {t_copy:.3f} ms ({memcpy_bw / 1e12:.2f} TB/s r+w), SDPA dense {t_sdpa:.3f} ms "
          f"({kv_bytes / (t_sdpa / 1e3) / 1e12:.2f} TB/s)")


def bench_copy(kv_layout: str, rows: list, results: dict) -> None:
    """The copy-on-write kernel in this process (a GpuPool of 4096 Llama-3-8B blocks, 8 GiB): c random distinct
    (src, dst) pairs, sources in one half, destinations in the other; vs one memcpy of the same bytes."""
    from kvpool.layout import KVLayout, blocks_view
    from kvpool_server.device.gpu_pool import GpuPool

    layout = KVLayout(32, 8, 128, 16, "float16", kv_layout)
    half = 2048
    rng = np.random.default_rng(3)
    with GpuPool(layout, 2 * half, staging_bytes=1 << 20) as gp:
        stream = cupy.cuda.Stream(non_blocking=True)
        spans, span_bytes = layout.copy_spans(gp.num_blocks)
        for c in (16, 256, 1024):
            sets = [cupy.asarray(np.stack([rng.permutation(half)[:c], half + rng.permutation(half)[:c]], 1)
                                 .astype(np.int32).reshape(-1)) for _ in range(8)]
            t = graph_time(lambda i, s: gp.copier.launch(gp._base_ptr, sets[i].data.ptr, c, s), 8, stream)
            m = memcpy_time(c * layout.block_bytes, stream)
            rows.append((f"copy_blocks c={c} ({spans} x {span_bytes // 1024} KiB spans)", c * layout.block_bytes, t, m))
            results[f"copy_{c}"] = {"bytes": c * layout.block_bytes, "copy_s": t, "memcpy_s": m, "spans": spans}
        # correctness of the kernel as the server runs it (validate, upload, launch, sync), bit for bit over the
        # whole pool. Compared as integers: random bytes seen as float16 hold NaNs (NaN != NaN), which is why the
        # check used to print False for a correct copy.
        stream.synchronize()
        cupy.cuda.Device().synchronize()
        words = gp.pool_bytes // 8  # the pool itself, not a copy: one raw uint64 view of the allocation
        raw = cupy.ndarray((words,), dtype=cupy.uint64, memptr=cupy.cuda.MemoryPointer(gp._mem, 0))
        _fill_hash(raw)
        pairs = np.stack([rng.permutation(half)[:64], half + rng.permutation(half)[:64]], 1)
        before = [cupy.asnumpy(gp.blocks[int(s)]) for s in pairs[:, 0]]  # basic indexing: a view of one block
        differ = all(not np.array_equal(cupy.asnumpy(gp.blocks[int(d)]).view(np.uint16), b.view(np.uint16))
                     for d, b in zip(pairs[:, 1], before))
        gp.copy_blocks(pairs)
        after = [cupy.asnumpy(gp.blocks[int(d)]) for d in pairs[:, 1]]
        float_eq = all(np.array_equal(a, b) for a, b in zip(after, before))  # the old check
        blocks_ok = all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(after, before))
        expected = cupy.empty(words, dtype=cupy.uint64)  # the whole pool as it must be: the fill, then the copies
        _fill_hash(expected)
        exp_blocks = blocks_view(expected.view(layout.storage_dtype), layout, gp.num_blocks)
        exp_blocks[cupy.asarray(pairs[:, 1])] = exp_blocks[cupy.asarray(pairs[:, 0])]
        pool_ok = bool(cupy.array_equal(raw, expected))
        nans = int(cupy.isnan(gp.blocks[0]).sum())
        del expected, exp_blocks, raw
        results["copy_ok"] = bool(differ and blocks_ok and pool_ok)
        results["copy_check"] = {"dst_differed_before": differ, "blocks_bitwise": blocks_ok, "whole_pool": pool_ok,
                                 "float_compare": float_eq, "nans_in_block0": nans}
        print(f"copy_blocks ({kv_layout}) correct: {results['copy_ok']} (64 pairs; destinations differed before: "
              f"{differ}; copied blocks bit-identical: {blocks_ok}; whole {gp.pool_bytes >> 30} GiB pool as "
              f"expected: {pool_ok}; the old float compare: {float_eq}, {nans} NaN halves in block 0)", flush=True)


_HASH = None


def _fill_hash(words) -> None:
    """words[i] = a 64-bit hash of i (splitmix64): every byte of the pool distinct-looking, reproducible."""
    global _HASH
    if _HASH is None:
        _HASH = cupy.ElementwiseKernel(
            "", "uint64 w",
            "unsigned long long z = (unsigned long long)i * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;"
            "z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;"
            "w = z ^ (z >> 31);", "kvpool_fill_hash")
    _HASH(words)


def bench_model(address: str, results: dict, steps: int = 10, prompt_len: int = 512) -> None:
    """The integration's per-step overhead: a random Llama-3-8B (HF ``LlamaForCausalLM``, fp16, SDPA) decoding
    one token for each of B sequences, with its KV in kvpool (``KVPoolLlama``: Append + BlockTable RPCs, per-layer
    ``write_layer``, Triton paged decode) vs the same model with its own dense ``DynamicCache``; same batch,
    same prompt length, a synchronize after every step. The kvpool step's RPCs and KV writes are timed inside it
    (host wall time of the calls: the step is host-bound at these sizes, so that is what they add). The client's
    ``append`` and ``block_table`` count as RPCs (the integration keeps block tables from Append replies, so a
    known sequence costs no BlockTable call)."""
    import transformers

    from kvpool_client.integrations.hf_llama import KVPoolLlama

    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=8192,
                                      attn_implementation="sdpa", initializer_range=0.02)
    torch.set_default_dtype(torch.float16)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    print(f"random Llama-3-8B on the GPU in {time.perf_counter() - t0:.1f} s", flush=True)
    spent = {"rpc": 0.0, "write": 0.0, "rpc_calls": 0}

    def timed(fn, key):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
                spent[key + "_calls"] = spent.get(key + "_calls", 0) + 1
        return call

    out = {}
    with KVPoolClient(address) as client:
        runner = KVPoolLlama(model, client)
        client.append = timed(client.append, "rpc")
        client.block_table = timed(client.block_table, "rpc")
        runner.pool.write_layer = timed(runner.pool.write_layer, "write")
        gen = torch.Generator().manual_seed(0)
        for batch in (1, 16, 64):
            prompt = torch.randint(0, 128256, (batch, prompt_len), generator=gen)
            tokens = torch.randint(0, 128256, (steps + 3, batch, 1), generator=gen)
            with torch.no_grad():  # dense: the model's own cache
                cache = transformers.DynamicCache()
                model(input_ids=prompt.cuda(), past_key_values=cache, use_cache=True, logits_to_keep=1)
                dense = []
                for i in range(steps + 3):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    model(input_ids=tokens[i].cuda(), past_key_values=cache, use_cache=True)
                    torch.cuda.synchronize()
                    dense.append(time.perf_counter() - t)
                del cache
            seqs = [client.register() for _ in range(batch)]
            for i in range(0, batch, 16):  # prefill 16 at a time (all positions' logits come back)
                runner.forward(seqs[i : i + 16], prompt[i : i + 16])
            paged, rpc, write = [], [], []
            for i in range(steps + 3):
                spent["rpc"] = spent["write"] = spent["rpc_calls"] = 0
                torch.cuda.synchronize()
                t = time.perf_counter()
                runner.forward(seqs, tokens[i])
                torch.cuda.synchronize()
                paged.append(time.perf_counter() - t)
                rpc.append(spent["rpc"])
                calls = spent["rpc_calls"]
                write.append(spent["write"])
            client.free(seqs)
            td, tp = statistics.median(dense[3:]), statistics.median(paged[3:])
            tr, tw = statistics.median(rpc[3:]), statistics.median(write[3:])
            out[batch] = {"dense_step_s": td, "kvpool_step_s": tp, "rpc_s": tr, "write_s": tw,
                          "overhead_share": (tr + tw) / tp, "context": prompt_len + 3 + steps, "rpcs_per_step": calls}
            print(f"model step, batch {batch}, context ~{prompt_len}: dense cache {td * 1e3:.2f} ms, kvpool "
                  f"{tp * 1e3:.2f} ms ({tp / td:.2f}x); in the kvpool step: RPCs {tr * 1e3:.2f} ms ({calls} "
                  f"call(s)), write_layer calls {tw * 1e3:.2f} ms (32 layers) = "
                  f"{(tr + tw) / tp:.1%} of the step", flush=True)
    results["model"] = out
    del model, runner
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--pool-gib", type=int, default=66)
    parser.add_argument("--kv-layout", choices=("block-major", "layer-major"), default="block-major")
    parser.add_argument("--quick", action="store_true", help="no latency loops, fewer sizes and attention configs")
    parser.add_argument("--sections", default="moves,attention,copy",
                        help="comma-separated: moves,attention,copy,model (model: the integration's step overhead)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    rows: list = []
    results: dict = {}
    if sections & {"moves", "attention", "model"}:
        proc, address = start_server(args.pool_gib, args.kv_layout)
        try:
            with KVPoolClient(address) as client:
                client.wait_until_serving(60)
                pool = client.attach()
                print(f"attached {pool.num_blocks} blocks of {pool.layout.block_bytes} B ({pool.layout.kv_layout}) "
                      "by CUDA IPC", flush=True)
                if "moves" in sections:
                    bench_moves(pool, rows, results, args.quick)
                if "attention" in sections:
                    bench_attention(pool, results, rows, args.quick)
                pool.close()
            if "model" in sections:
                bench_model(address, results)
        finally:
            proc.terminate()
            proc.wait(30)
    if "copy" in sections:
        bench_copy(args.kv_layout, rows, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\n[{args.kv_layout}] {'operation':44s} {'bytes':>10s} {'time':>10s} {'GB/s':>8s} {'vs memcpy':>9s}")
    for name, nbytes, t, m in rows:
        moved = nbytes if name.startswith(("paged", "SDPA", "Flex")) else 2 * nbytes  # attention: bytes read
        print(f"{name:44s} {nbytes:10d} {t * 1e6:8.1f}us {moved / t / 1e9:8.0f} {m / t:9.2f}")


if __name__ == "__main__":
    main()
