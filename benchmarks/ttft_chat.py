"""bench_ttft.py's chat workload (``--workload chat``): four engine processes, conversations spread over them.

    conversation c: system prompt c % S, then T turns; turn t = everything so far + a user message of U tokens,
                    answered with G greedy tokens; served by engine (c + t) % 4 -- so a conversation's next turn
                    lands on another engine, as a router that balances load does

Rounds: turn t of every conversation is sent at once (each engine serves its share one after the other), the next
round's prompts are built from the answers. Two variants, the same requests: ``shared`` -- four engines on one
kvpool server (one prefix cache) -- and ``private`` -- four in-process engines, each with its own prefix cache
(``LocalBlockCache``). Per request: TTFT (register to first token), cached tokens; per variant: TTFT p50 / p99,
generated tokens / s over the whole workload, the share of prompt tokens served from a cache, and whether both
variants gave the same answers.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

ENGINES = 4


def worker(index: int, address: str | None, args: argparse.Namespace, requests: Any, results: Any) -> None:
    """One engine process: requests (id, prompt) in, (id, ttft, cached, tokens) out, until None."""
    import torch  # noqa: PLC0415

    import bench_ttft  # noqa: PLC0415
    from bench_engine import build_model  # noqa: PLC0415
    from kvpool_client import KVPoolClient  # noqa: PLC0415
    from kvpool_client.integrations.engine import DecodeEngine  # noqa: PLC0415

    torch.set_num_threads(1)
    torch.manual_seed(bench_ttft.SEED)
    model = build_model(args)
    kwargs = bench_ttft.engine_kwargs(args)
    client = KVPoolClient(address) if address else None
    engine = DecodeEngine.on_pool(model, client, **kwargs) if client else \
        DecodeEngine.in_process(model, args.chat_blocks, bench_ttft.BLOCK_SIZE, **kwargs)
    results.put(("ready", index))
    for request in iter(requests.get, None):
        req_id, prompt = request
        ttft, cached, _, tokens, *_ = bench_ttft.first_token(engine, prompt, b"", args)
        results.put((req_id, ttft, cached, tokens))
    engine.close()
    if client:
        client.close()


def run_variant(address: str | None, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    queues = [ctx.Queue() for _ in range(ENGINES)]
    procs = [ctx.Process(target=worker, args=(i, address, args, queues[i], results)) for i in range(ENGINES)]
    for p in procs:
        p.start()
    for _ in procs:
        assert results.get(timeout=600)[0] == "ready"
    rng = np.random.default_rng(1)
    vocab = args.vocab
    systems = [rng.integers(0, vocab, args.system_tokens).tolist() for _ in range(args.systems)]
    history = [list(systems[c % args.systems]) for c in range(args.conversations)]
    ttfts, answers, cached_tokens, prompt_tokens, generated = [], [], 0, 0, 0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for c in range(args.conversations):
            history[c] += rng.integers(0, vocab, args.user_tokens).tolist()
            queues[(c + turn) % ENGINES].put(((turn, c), list(history[c])))
            prompt_tokens += len(history[c])
        replies = dict((r[0], r[1:]) for r in (results.get(timeout=600) for _ in range(args.conversations)))
        for c in range(args.conversations):
            ttft, cached, tokens = replies[(turn, c)]
            ttfts.append(ttft)
            cached_tokens += cached
            generated += len(tokens)
            answers.append(tokens)
            history[c] += tokens
    wall = time.perf_counter() - t0
    for q in queues:
        q.put(None)
    for p in procs:
        p.join(timeout=60)
    ttfts.sort()
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "tokens_per_s": generated / wall, "cached_share": cached_tokens / prompt_tokens, "answers": answers,
            "requests": len(ttfts)}


def main(args: argparse.Namespace, start_server: Any, layout: Any) -> dict:
    max_len = args.system_tokens + args.turns * (args.user_tokens + args.new_tokens)
    args.prefix, args.suffix = max_len, 0  # engine_kwargs: every request fits
    # nothing evicted, either variant: every system prompt's blocks and every conversation's longest prompt, and
    # the blocks of the requests running at once (one an engine)
    args.chat_blocks = (args.systems * args.system_tokens + args.conversations * max_len) // 16 \
        + ENGINES * (max_len // 16 + 2) + 8
    out: dict = {}
    proc, address = start_server(args, layout, args.chat_blocks)
    try:
        out["shared"] = run_variant(address, args)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    out["private"] = run_variant(None, args)
    for name, r in out.items():
        print(f"chat {name:7s}: {r['requests']} requests, TTFT p50 {r['ttft_p50_s'] * 1e3:.2f} ms, p99 "
              f"{r['ttft_p99_s'] * 1e3:.2f} ms, {r['tokens_per_s']:.1f} generated tokens/s, "
              f"{r['cached_share']:.0%} of prompt tokens from a cache", flush=True)
    s, p = out["shared"], out["private"]
    same = s["answers"] == p["answers"]
    print(f"chat: TTFT p50 {s['ttft_p50_s'] * 1e3:.2f} ms shared vs {p['ttft_p50_s'] * 1e3:.2f} ms private "
          f"({p['ttft_p50_s'] / s['ttft_p50_s']:.1f}x); p99 {s['ttft_p99_s'] * 1e3:.2f} vs "
          f"{p['ttft_p99_s'] * 1e3:.2f} ms; {s['tokens_per_s']:.1f} vs {p['tokens_per_s']:.1f} generated tokens/s; "
          f"tokens identical: {'yes' if same else 'no'}")
    for r in out.values():
        del r["answers"]
    return out
