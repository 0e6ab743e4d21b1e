#!/usr/bin/env python3
"""The decode engine on kvpool's pool against the same engine with an in-process cache, and the roofline.

    python3 benchmarks/bench_engine.py --json $OUT/engine.json        (CUDA: random Llama-3-8B, fp16)
    python3 benchmarks/bench_engine.py --quick                         (CUDA: 8 layers, batch 1/64, context 512)
    python3 benchmarks/bench_engine.py --device cpu --tiny             (anywhere: the shape of the table)

A random-weight Llama (transformers ``LlamaForCausalLM``; full: Llama-3-8B's config, 32 layers, 32 query / 8 KV
heads, head_dim 128, vocab 128256, fp16) runs in ``DecodeEngine`` twice: ``on_pool`` (a kvpool server process,
its pool attached by CUDA IPC, control calls over ``KVPoolClient``'s shared-memory fast path (``--control
fast``, the default: the server is on this host), one ``AppendTokenStream`` (``stream``) or unary gRPC calls
(``unary``)) and ``in_process`` (``LocalBlockCache`` over a
``torch.zeros`` cache of the same shape and layout). Same kernels, same graphs, same batches.

For each context (~512, ~2048) and batch (1, 16, 64, 256): B sequences get the context appended without compute
(``engine.reserve``: the decode reads those blocks like any others), then decode steps, one CUDA graph replay each:

    step (overlapped)  what ``generate`` does: step t+1's Append runs on the host while step t runs on the device;
                       wall time per step over STEPS steps, tokens/s = B / step
    serial parts       the same steps one after the other: control (Append + table update + staging, host),
                       device (H2D of the inputs + graph replay, CUDA events), the rest (argmax, token copy-back)
    roofline           bytes a step must read (every weight once -- the embedding only its B rows -- plus every
                       context token's K and V of every layer) / the copy bandwidth measured in this run
                       (``dst.copy_(src)`` of 2 GiB, bytes read + written per second)

overhead = kvpool step / in-process step - 1 (the target: <= 5%); the ratio to the roofline (target: <= 1.3 at
batch 64). Each variant runs alone on the device: per context, a server with a pool sized for it, the kvpool
variant, the server stopped, then the in-process variant with a cache of the same size; the table so far is
printed (and the JSON written) after each context.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_client.integrations.engine import DecodeEngine  # noqa: E402
from kvpool_client.integrations.layer_helpers import NAMES  # noqa: E402
from kvpool_client.integrations.hf_llama import layout_for  # noqa: E402

FULL = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0)
TINY = dict(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32)
BLOCK_SIZE, WARMUP = 16, 3


def build_model(args: argparse.Namespace) -> transformers.LlamaForCausalLM:
    shape = dict(TINY if args.tiny else FULL)
    if args.quick and not args.tiny:
        shape["num_hidden_layers"] = 8
    config = transformers.LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False,
                                      initializer_range=0.02, attn_implementation="sdpa")
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        with torch.device(args.device):
            return transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def start_server(args: argparse.Namespace, layout, num_blocks: int,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    port_file = Path(f"/tmp/kvpool_bench_engine_port.{os.getpid()}")
    port_file.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path[:3] + [os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "kvpool_server", "--backend", "gpu" if args.device == "cuda" else "host",
           "--num-blocks", str(num_blocks),
           "--num-layers", str(layout.num_layers), "--num-kv-heads", str(layout.num_kv_heads),
           "--head-dim", str(layout.head_dim), "--block-size", str(layout.block_size), "--dtype", layout.dtype,
           "--kv-layout", args.kv_layout, "--address", "127.0.0.1:0", "--port-file", str(port_file),
           "--log-level", "WARNING", *extra]
    proc = subprocess.Popen(cmd, env=env)
    for _ in range(600):
        if port_file.exists() and port_file.read_text().strip():
            return proc, f"127.0.0.1:{port_file.read_text().strip()}"
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not start")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes read + written per second by ``dst.copy_(src)``, median of 10."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    del src, dst
    return 2 * nbytes / statistics.median(times[2:])


def measure(engine: DecodeEngine, batch: int, context: int, steps: int, device: str) -> dict:
    seqs = [engine.add_sequence() for _ in range(batch)]
    for i in range(0, batch, 16):  # Append replies stay small (16 x context slots)
        engine.reserve(seqs[i:i + 16], context)
    tokens = [1] * batch
    for _ in range(WARMUP):
        tokens = engine.decode(seqs, tokens).argmax(-1).tolist()
    sync(device)
    t0 = time.perf_counter()  # overlapped, as generate() runs
    plan = engine.plan_decode(seqs)
    for i in range(steps):
        logits = engine.run_decode(plan, tokens)
        if i + 1 < steps:
            plan = engine.plan_decode(seqs)
        tokens = logits.argmax(-1).tolist()
    step = (time.perf_counter() - t0) / steps
    control, dev, rest, enqueue = [], [], [], []
    for _ in range(steps):  # serial: each part on its own
        sync(device)
        t = time.perf_counter()
        plan = engine.plan_decode(seqs)
        t1 = time.perf_counter()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        logits = engine.run_decode(plan, tokens)
        enqueue.append(time.perf_counter() - t1)
        if device == "cuda":
            end.record()
        tokens = logits.argmax(-1).tolist()
        t2 = time.perf_counter()
        d = start.elapsed_time(end) / 1e3 if device == "cuda" else t2 - t1
        control.append(t1 - t)
        dev.append(d)
        rest.append(t2 - t1 - d)
    engine.check_errors()
    engine.free(seqs)
    c, d, r = (statistics.median(x) for x in (control, dev, rest))
    return {"step_s": step, "tokens_per_s": batch / step, "control_s": c, "device_s": d, "rest_s": max(r, 0.0),
            "serial_s": c + d + max(r, 0.0), "enqueue_s": statistics.median(enqueue)}


def run_variant(name: str, make_engine, args, results: dict, context: int) -> None:
    try:
        run_context(name, make_engine, args, results, context)
    except Exception as e:  # noqa: BLE001  (the other variant and the other contexts still run)
        print(f"  {name} context {context}: FAILED {e!r}", flush=True)
        import traceback  # noqa: PLC0415

        traceback.print_exc()


def run_context(name: str, make_engine, args, results: dict, context: int) -> None:
    engine = make_engine(max_batch=max(args.batches), max_model_len=context + 2 * args.steps + 2 * WARMUP + 32,
                         graph_sizes=list(args.batches), helpers=args.helpers)
    print(f"  {name}: graphs for batches {sorted(engine.graphs) or 'none (eager)'}, elementwise helpers "
          f"{engine.model.helpers}", flush=True)
    try:
        for batch in args.batches:
            r = measure(engine, batch, context, args.steps, args.device)
            results.setdefault((context, batch), {})[name] = r
            print(f"  {name:10s} context {context:5d} batch {batch:4d}: step {r['step_s'] * 1e3:8.3f} ms "
                  f"(serial: control {r['control_s'] * 1e3:.3f} + device {r['device_s'] * 1e3:.3f} + rest "
                  f"{r['rest_s'] * 1e3:.3f} ms)", flush=True)
    finally:
        engine.close()
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="the tests' 3-layer model (runs on the CPU)")
    p.add_argument("--quick", action="store_true", help="8 layers, batch 1 and 64, context 512")
    p.add_argument("--batches", default=None, help="comma-separated (default 1,16,64,256)")
    p.add_argument("--contexts", default=None, help="comma-separated (default 512,2048)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kv-layout", default="block-major", choices=["block-major", "layer-major"])
    p.add_argument("--helpers", default=None, choices=NAMES, help="the elementwise helpers (default: Liger's "
                   "kernels on CUDA when installed, else torch.compile; eager on the CPU: ``layer_helpers``)")
    p.add_argument("--control", default="fast", choices=["fast", "stream", "unary"],
                   help="kvpool's control path: the fast path (default), one AppendTokenStream, unary gRPC calls")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.dtype = "float16" if args.device == "cuda" else "float32"
    quick = args.quick or (args.tiny and args.device == "cpu")
    args.batches = [int(x) for x in (args.batches or ("1,64" if quick else "1,16,64,256")).split(",")]
    args.contexts = [int(x) for x in (args.contexts or ("512" if quick else "512,2048")).split(",")]
    t0 = time.perf_counter()
    model = build_model(args)
    layout = layout_for(model.config, BLOCK_SIZE, args.dtype, args.kv_layout)
    print(f"model: {model.config.num_hidden_layers} layers, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}"
          f" B parameters, {args.dtype} on {args.device} ({time.perf_counter() - t0:.1f} s)", flush=True)
    bandwidth = copy_bandwidth(args.device, (2 << 30) if args.device == "cuda" else (64 << 20))
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
    results: dict = {}
    for context in args.contexts:  # per context: a pool of its size, kvpool then in-process, the table so far
        max_len = context + 2 * args.steps + 2 * WARMUP + 32
        num_blocks = max(args.batches) * -(-max_len // BLOCK_SIZE) + 2 * max(args.batches) + 8
        print(f"context {context}: pool of {num_blocks} blocks of {layout.block_bytes >> 10} KiB", flush=True)
        proc, address = start_server(args, layout, num_blocks)
        try:
            with KVPoolClient(address, fast_path=args.control == "fast") as client:
                if args.control == "fast" and not client.fast_path_enabled:
                    raise SystemExit(f"the fast path is off for {address}")
                run_variant("kvpool", lambda **kw: DecodeEngine.on_pool(model, client,
                                                                         append_stream=args.control == "stream",
                                                                         **kw), args, results, context)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        run_variant("in-process", lambda n=num_blocks, **kw: DecodeEngine.in_process(model, n, BLOCK_SIZE, **kw),
                    args, results, context)
        report(model, layout, args, results, bandwidth)
    if args.device == "cuda":
        print(f"peak memory of this process: {torch.cuda.max_memory_allocated() / (1 << 30):.1f} GiB "
              "(model, fused weight copies, graphs; the in-process cache included)")


def report(model, layout, args, results: dict, bandwidth: float) -> None:
    item = torch.finfo(getattr(torch, args.dtype)).bits // 8
    weights = sum(p.numel() for p in model.parameters()) * item
    embed = model.model.embed_tokens.weight
    rows = []
    print(f"\n{'context':>7} {'batch':>5} | {'kvpool ms':>9} {'in-proc ms':>10} {'overhead':>8} | "
          f"{'kvpool tok/s':>12} {'in-proc tok/s':>13} | {'roofline ms':>11} {'x roof kvpool':>13} "
          f"{'x roof in-proc':>14} | {'control ms kvpool/in-proc':>25} {'device ms':>9} {'model share':>11} "
          f"{'enqueue us':>10}")
    for (context, batch), r in sorted(results.items()):
        if len(r) < 2:
            print(f"{context:>7} {batch:>5} | only {list(r)} measured")
            continue
        kv, lo = r["kvpool"], r["in-process"]
        mean_ctx = context + WARMUP + args.steps // 2
        step_bytes = (weights - embed.numel() * item + batch * embed.shape[1] * item
                      + batch * mean_ctx * layout.token_bytes)
        roof = step_bytes / bandwidth
        row = {"context": context, "batch": batch, "kvpool": kv, "in_process": lo, "roofline_s": roof,
               "step_bytes": step_bytes, "overhead": kv["step_s"] / lo["step_s"] - 1}
        rows.append(row)
        print(f"{context:>7} {batch:>5} | {kv['step_s'] * 1e3:9.3f} {lo['step_s'] * 1e3:10.3f} "
              f"{row['overhead']:+8.1%} | {kv['tokens_per_s']:12.0f} {lo['tokens_per_s']:13.0f} | "
              f"{roof * 1e3:11.3f} {kv['step_s'] / roof:13.2f} {lo['step_s'] / roof:14.2f} | "
              f"{kv['control_s'] * 1e3:12.3f} / {lo['control_s'] * 1e3:10.3f} {kv['device_s'] * 1e3:9.3f} "
              f"{kv['device_s'] / kv['serial_s']:11.0%} {kv['enqueue_s'] * 1e6:10.0f}")
    print(f"\noverhead: kvpool step / in-process step - 1 (steps overlapped: step t+1's Append during step t's "
          f"replay). control: the serial Append + table update + staging; model share: device time / serial step; "
          f"enqueue: host time of run_decode (input copies + one graph replay: all of the data path's host time). "
          f"Roofline at {bandwidth / 1e9:.0f} GB/s (copy, read + write).")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda"
                                               else "cpu", "bandwidth": bandwidth, "layers":
                                               model.config.num_hidden_layers, "rows": rows}, indent=1))


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    main()
