#!/usr/bin/env python3
"""Time to first token of kvpool's engine, a prompt's prefix served from the pool against recomputing it.

    python3 benchmarks/bench_ttft.py --json $OUT/ttft.json            (CUDA: random Llama-3-8B fp16, 4,096 + 256)
    python3 benchmarks/bench_ttft.py --device cpu --tiny               (anywhere: 3 layers, 256 + 32 tokens)
    python3 benchmarks/bench_ttft.py --tier                            (also the prefix from the host tier: ttft_tier.py)
    python3 benchmarks/bench_ttft.py --workload chat [--device cpu --tiny]   (four engine processes: ttft_chat.py)

A writer process (its own model from the same seed, its own client and session) generates from ``prefix + its
own suffix``, so the prefix's blocks are sealed in the pool, and exits. Then, for each of ``--repeats`` prompts
``prefix + suffix_i`` (a fresh suffix each), the reader engine (this process) measures

    hit        ``generate`` with the shared cache: RegisterSequence with the prompt's token ids -> the prefix's
               blocks as its cached run, the suffix's tokens appended and prefilled (attention over the pool)
    recompute  the same prompt under a cache key nobody used (``cache_extra_key``): nothing cached, all of it
               prefilled

TTFT = from the register to the first token on the host (register, GetBlockTable, Append, prefill forward,
argmax). The medians are reported; ``--new-tokens`` greedy tokens of both are compared (tokens identical: the
cached KV gave what recomputing gives), and where they part, the recompute's top-2 margin there (a random-weight
model's near ties, which fp16 rounding of different GEMM shapes may flip), with the first token's logit error. The same for the in-process baseline (``DecodeEngine.in_process``: the same
prefix cache over ``LocalBlockCache``), its prefix written by the same engine. The last line:

    prefix reuse: <cached>/<prompt> prompt tokens served from the pool; TTFT hit <a> ms vs recompute <b> ms (<b/a>x);
    tokens identical: yes|no
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "common"), str(ROOT / "client"), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_engine import build_model, start_server  # noqa: E402
from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_client.integrations.engine import DecodeEngine  # noqa: E402
from kvpool_client.integrations.layer_helpers import NAMES  # noqa: E402
from kvpool_client.integrations.hf_llama import layout_for  # noqa: E402

BLOCK_SIZE, SEED = 16, 0


def prompts(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[int]]]:
    """The shared prefix, and ``repeats + 2`` suffixes: the writer's, a warm-up's, one per repeat."""
    rng = np.random.default_rng(SEED)
    prefix = rng.integers(0, vocab, args.prefix).tolist()
    return prefix, [rng.integers(0, vocab, args.suffix).tolist() for _ in range(args.repeats + 2)]


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"max_batch": 1, "max_model_len": args.prefix + args.suffix + args.new_tokens + BLOCK_SIZE,
            "graph_sizes": [1], "helpers": args.helpers}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def first_token(engine: DecodeEngine, prompt: list[int], key: bytes, args: argparse.Namespace) -> tuple:
    """(TTFT s, cached tokens, first token, the greedy tokens after it, the register's s, the logits of each of
    those tokens [new_tokens, V] float32 on the host); the sequence freed."""
    sync(args.device)
    t0 = time.perf_counter()
    seq, cached = engine.add_prompt(prompt, key)
    registered = time.perf_counter() - t0
    try:
        first = engine.prefill([seq], [prompt[cached:]])[0]
        token = int(first.argmax())
        ttft = time.perf_counter() - t0
        tokens, logits = [token], [first.float().cpu()]
        for _ in range(args.new_tokens - 1):
            logits.append(engine.decode([seq], [tokens[-1]])[0].float().cpu())  # a copy: a graph's output is reused
            tokens.append(int(logits[-1].argmax()))
        engine.check_errors()
    finally:
        engine.free([seq])
    return ttft, cached, token, tokens, registered, torch.stack(logits)


def agreement(hit: tuple, miss: tuple) -> dict:
    """How a hit's output compares with the recompute's: the first-token logits' largest difference over the largest
    |logit|, and where the greedy tokens first differ (None: nowhere) with the recompute's top-2 margin there over
    its largest |logit| (a margin of the size of the logits' difference is a near tie either rounding may flip)."""
    hit_logits, miss_logits = hit[5], miss[5]
    scale = float(miss_logits[0].abs().max())
    out = {"logits_error": float((hit_logits[0] - miss_logits[0]).abs().max()) / scale, "first_difference": None,
           "margin_there": None, "error_there": None}
    step = next((j for j, (a, b) in enumerate(zip(hit[3], miss[3])) if a != b), None)
    if step is not None:
        top2 = miss_logits[step].topk(2).values
        there = float(miss_logits[step].abs().max())
        out["first_difference"] = step
        out["margin_there"] = float(top2[0] - top2[1]) / there
        out["error_there"] = float((hit_logits[step] - miss_logits[step]).abs().max()) / there
    return out


def measure(engine: DecodeEngine, args: argparse.Namespace, prefix: list[int], suffixes: list[list[int]]) -> dict:
    first_token(engine, prefix + suffixes[1], b"warm-up", args)  # kernels, allocator, graphs warm
    first_token(engine, prefix + suffixes[1], b"", args)
    hits, misses, same, cached, registers, agreements = [], [], True, [], [], []
    for i, suffix in enumerate(suffixes[2:]):
        hit = first_token(engine, prefix + suffix, b"", args)
        miss = first_token(engine, prefix + suffix, f"recompute-{i}".encode(), args)
        if miss[1]:
            raise RuntimeError(f"the recompute run found {miss[1]} tokens cached")
        hits.append(hit[0])
        registers.append(hit[4])
        misses.append(miss[0])
        cached.append(hit[1])
        same &= hit[3] == miss[3]
        agreements.append(agreement(hit, miss))
    return {"hit_s": statistics.median(hits), "recompute_s": statistics.median(misses), "hits_s": hits,
            "hit_register_s": statistics.median(registers),
            "recomputes_s": misses, "cached": min(cached), "prompt": len(prefix) + len(suffixes[0]),
            "tokens_identical": same, "agreement": agreements}


def describe_agreement(r: dict) -> str:
    """One clause: the largest first-token logit error, and each prompt whose tokens differ, where and how close."""
    agreements = r.get("agreement") or []
    if not agreements:
        return ""
    text = f"first-token logits within {max(a['logits_error'] for a in agreements):.1e} of the largest"
    parted = [(i, a) for i, a in enumerate(agreements) if a["first_difference"] is not None]
    if parted:
        text += "; tokens part at " + ", ".join(f"prompt {i} step {a['first_difference']} (there the recompute's "
                                               f"top-2 margin {a['margin_there']:.1e}, the logits' difference "
                                               f"{a['error_there']:.1e})" for i, a in parted)
    return text


def writer(args: argparse.Namespace) -> None:
    """The other frontend: the prefix's blocks written and sealed (two tokens generated), then gone."""
    model = build_model(args)
    prefix, suffixes = prompts(args, model.config.vocab_size)
    with KVPoolClient(args.address) as client:
        engine = DecodeEngine.on_pool(model, client, **engine_kwargs(args))
        engine.generate([prefix + suffixes[0]], 2)
        engine.close()


def run_writer(args: argparse.Namespace, address: str) -> None:
    """The writer (``writer``) in a process of its own, against the server at ``address``; returns once it exited."""
    cmd = [sys.executable, __file__, "--role", "writer", "--address", address, "--device", args.device,
           "--prefix", str(args.prefix), "--suffix", str(args.suffix), "--repeats", str(args.repeats),
           "--new-tokens", str(args.new_tokens), "--kv-layout", args.kv_layout]
    cmd += [f for f, on in (("--tiny", args.tiny), ("--quick", args.quick)) if on]
    cmd += ["--helpers", args.helpers] if args.helpers else []
    subprocess.run(cmd, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="the tests' 3-layer model (runs on the CPU)")
    p.add_argument("--quick", action="store_true", help="8 layers (bench_engine's --quick model)")
    p.add_argument("--prefix", type=int, default=None, help="cached prefix tokens (4096; --tiny: 256)")
    p.add_argument("--suffix", type=int, default=None, help="computed suffix tokens (256; --tiny: 32)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens compared, hit against recompute")
    p.add_argument("--helpers", default=None, choices=NAMES, help="the elementwise helpers (default: the engine's, "
                   "``layer_helpers.default_helpers``)")
    p.add_argument("--kv-layout", default="block-major", choices=["block-major", "layer-major"])
    p.add_argument("--workload", default="single", choices=["single", "chat"],
                   help="chat: four engine processes, conversations spread over them (ttft_chat.py)")
    p.add_argument("--systems", type=int, default=None, help="chat: system prompts (4; --tiny: 2)")
    p.add_argument("--system-tokens", type=int, default=None, help="chat: a system prompt's tokens (2048; --tiny: 96)")
    p.add_argument("--conversations", type=int, default=None, help="chat: conversations (16; --tiny: 8)")
    p.add_argument("--turns", type=int, default=None, help="chat: turns a conversation (4; --tiny: 3)")
    p.add_argument("--user-tokens", type=int, default=None, help="chat: a user message's tokens (128; --tiny: 16)")
    p.add_argument("--tier", action="store_true", help="also the prefix served from the host tier (ttft_tier.py)")
    p.add_argument("--verbose-tier", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    p.add_argument("--role", default="reader", choices=["reader", "writer"], help=argparse.SUPPRESS)
    p.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.dtype = "float16" if args.device == "cuda" else "float32"
    args.prefix = args.prefix or (256 if args.tiny else 4096)
    args.suffix = args.suffix or (32 if args.tiny else 256)
    torch.manual_seed(SEED)  # the writer's model is the reader's: the same seed, the same device
    if args.role == "writer":
        writer(args)
        return
    model = build_model(args)
    layout = layout_for(model.config, BLOCK_SIZE, args.dtype, args.kv_layout)
    if args.workload == "chat":
        import ttft_chat  # noqa: PLC0415

        for name, full, tiny in (("systems", 4, 2), ("system_tokens", 2048, 96), ("conversations", 16, 8),
                                 ("turns", 4, 3), ("user_tokens", 128, 16)):
            if getattr(args, name) is None:
                setattr(args, name, tiny if args.tiny else full)
        args.vocab = model.config.vocab_size
        del model
        out = ttft_chat.main(args, start_server, layout)
        if args.json:
            Path(args.json).write_text(json.dumps({"workload": "chat", **vars(args), **out}, indent=1, default=str))
        return
    prefix, suffixes = prompts(args, model.config.vocab_size)
    per_prompt = -(-engine_kwargs(args)["max_model_len"] // BLOCK_SIZE)
    num_blocks = per_prompt * (2 * args.repeats + 6) + 8  # every prompt's blocks stay cached: nothing evicted
    print(f"model: {model.config.num_hidden_layers} layers, {args.dtype} on {args.device}; prompt {args.prefix} "
          f"+ {args.suffix} tokens; pool of {num_blocks} blocks", flush=True)
    results: dict = {}
    proc, address = start_server(args, layout, num_blocks)
    try:
        run_writer(args, address)
        with KVPoolClient(address) as client:
            engine = DecodeEngine.on_pool(model, client, **engine_kwargs(args))
            results["kvpool"] = measure(engine, args, prefix, suffixes)
            results["kvpool"]["prefix_hit_tokens"] = client.stats().prefix_hit_tokens
            engine.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if args.tier:
        import ttft_tier  # noqa: PLC0415

        args.vocab = model.config.vocab_size
        results["host tier"] = ttft_tier.measure(args, model, layout, prefix, suffixes, start_server)
    local = DecodeEngine.in_process(model, num_blocks, BLOCK_SIZE, **engine_kwargs(args))
    local.generate([prefix + suffixes[0]], 2)  # its prefix, written by the same engine
    results["in-process"] = measure(local, args, prefix, suffixes)
    for name, r in results.items():
        if name == "host tier":
            import ttft_tier  # noqa: PLC0415

            ttft_tier.report(r)
            continue
        print(f"{name:10s}: TTFT hit {r['hit_s'] * 1e3:8.2f} ms (of which the register {r['hit_register_s'] * 1e3:.2f}"
              f" ms; {r['cached']}/{r['prompt']} cached), recompute "
              f"{r['recompute_s'] * 1e3:8.2f} ms, {r['recompute_s'] / r['hit_s']:.1f}x; tokens identical: "
              f"{'yes' if r['tokens_identical'] else 'no'}", flush=True)
        if r.get("agreement"):
            print(f"{'':10s}  {describe_agreement(r)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda"
                                               else "cpu", "layers": model.config.num_hidden_layers,
                                               "prefix": args.prefix, "suffix": args.suffix, **results}, indent=1))
    r = results["kvpool"]
    print(f"prefix reuse: {r['cached']}/{r['prompt']} prompt tokens served from the pool; TTFT hit "
          f"{r['hit_s'] * 1e3:.2f} ms vs recompute {r['recompute_s'] * 1e3:.2f} ms "
          f"({r['recompute_s'] / r['hit_s']:.1f}x); tokens identical: {'yes' if r['tokens_identical'] else 'no'}")


if __name__ == "__main__":
    main()
