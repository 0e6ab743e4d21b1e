"""kvpool's core against vLLM v1's BlockPool on one workload: register + prefill, decode, free (caching on / off).

``--prefix-caching on|off|both`` (both by default, one after the other in one run, each with its own pools).
*on*, one cycle: N sequences registered with distinct prompts (prompt lengths drawn in [--min-prompt, --max-prompt]),
each prompt prefilled (ceil(prompt / block_size) blocks, its full blocks hashed and cached), then --decode-steps
steps that append one token to every sequence (a new block every block_size tokens, each block hashed and cached as
it fills), then every sequence freed. Both sides get the same token ids; each keeps its pool across rounds, so later
rounds evict the blocks cached by earlier ones. Rounds alternate which side runs first; one warm-up round is not
counted; the figures are medians over --rounds rounds (9; ``--stat min``: the least
disturbed round).

*off*, the same cycle as plain block management: no token ids reach kvpool (``register_many(N)``, ``append(ids,
counts)``, ``append(ids)`` / ``SequenceBatch.step()``: nothing hashed, looked up or sealed), and vLLM runs as with
``--no-enable-prefix-caching`` (``VllmDriver(enable_caching=False)``: no block hasher, no lookup, no caching, its
BlockPool built with ``enable_caching=False``). vLLM still appends each sampled token to its Request, as its
scheduler does; that is how its manager learns the request's length. After each mode the blocks each side holds in
its prefix cache are printed (``cached blocks``): 0 on every side when caching is off.

- vLLM: its own BlockPool, KVCacheBlock, FreeKVCacheBlockQueue and block hashing (sha256, its default), loaded
  from extracted source files (``--vllm-src DIR``, see ``scripts/extract_vllm_core.sh``), driven the way its
  KVCacheManager / FullAttentionManager drive them, one request at a time (``vllm_block_pool.py`` says what it
  runs and what is stubbed). Its calls give block ids; vLLM computes the slot mapping later, in its model runner.
- kvpool, *batched*: one ``manager.register_many(N, prompt_token_ids=...)`` for the burst of new sequences (what
  a frontend's RegisterSequences does; each prompt looked up in the prefix cache; on code before ``register_many``,
  a ``manager.register`` per sequence), one ``manager.append(ids, counts, token_ids=...)`` for all prefills, one ``manager.append(ids, token_ids=...)`` a
  decode step, one ``manager.free(ids)``. Each append also produces the slot of every token.
- kvpool, *persistent*: the same, but the decode steps run ``SequenceBatch.step(token_ids)``
  (``persistent_batch.py``: rows resolved once when the batch is built, at register time).

Where the phases differ in what they hold: vLLM caches a full block when its slot is allocated (the prompt's in
the prefill), kvpool seals it with the sequence's next append (docs/prefix-caching.md), so the prompt's blocks
enter kvpool's cache in the first decode step -- that work is in kvpool's decode phase and in vLLM's prefill. The
cycle holds the same work on both sides. (A block filled by a sequence's last append is hashed but never sealed by
kvpool, as the sequence is freed next: at most one block a sequence.)

Ratios are vLLM / kvpool: above 1 means kvpool is faster. Without vLLM's files only kvpool's figures are printed.

    scripts/extract_vllm_core.sh <vllm git dir | vllm checkout | vllm wheel> .vllm-src   # ignored by git
    taskset -c 1 .venv/bin/python benchmarks/bench_vs_vllm.py --vllm-src .vllm-src      # or --cpu 1
    make bench VLLM_SRC=.vllm-src                     # bench_core.py, then this (kvpool alone without VLLM_SRC)

Pinning: ``taskset -c N`` (or ``--cpu N``) keeps the process on one core, away from the other work of the host.
The three files (90-150 KB) are all it reads of vLLM: a host without vLLM or its network gets them with the
working tree (an ignored folder such as ``.vllm-src/``, carried). The ratio of the whole cycle depends on the mix:
kvpool's batched decode step gains most on vLLM's per-request decode loop, its register and prefill (each prompt
block hashed once, by the register) less, so fewer decode steps (``--decode-steps``) give a lower ratio; say which
mix a figure is for.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvpool_server.core import KVCacheManager
from persistent_batch import SequenceBatch

# --clock: wall time (the default), or this process's CPU time (``cpu``: steadier where other work shares the CPUs)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = "wall"

PHASES = ("register+prefill", "decode", "free", "cycle")


class Workload:
    """One round's token ids: prompts (arrays for kvpool, lists for vLLM, both made before timing) and decode
    tokens ([steps, sequences])."""

    def __init__(self, args: argparse.Namespace, rng: np.random.Generator) -> None:
        lengths = rng.integers(args.min_prompt, args.max_prompt + 1, size=args.num_seqs)
        self.prompts = [rng.integers(0, 2**31, size=int(n), dtype=np.uint32) for n in lengths]
        self.prompt_lists = [p.tolist() for p in self.prompts]
        self.prefill_counts = lengths.astype(np.int64)
        self.prefill_tokens = np.concatenate(self.prompts)
        self.decode_tokens = rng.integers(0, 2**31, size=(args.decode_steps, args.num_seqs), dtype=np.uint32)
        self.decode_lists = self.decode_tokens.tolist()


def needed_blocks(args: argparse.Namespace) -> int:
    return args.num_seqs * -(-(args.max_prompt + args.decode_steps) // args.block_size)


def run_kvpool(manager: KVCacheManager, work: Workload, persistent: bool, caching: bool) -> dict[str, float]:
    """One cycle on kvpool's core; seconds per phase. Without caching no token id is passed (plain blocks)."""
    clock = CLOCKS[CLOCK]
    hits = manager.prefix.hit_tokens
    decode_tokens = work.decode_tokens if caching else [None] * len(work.decode_tokens)
    start = clock()
    register, register_many = manager.register, getattr(manager, "register_many", None)  # None: code before it
    num = len(work.prompts)
    if caching:
        ids = np.array(register_many(num, prompt_token_ids=work.prompts) if register_many is not None else
                       [register(prompt_token_ids=p) for p in work.prompts], dtype=np.uint64)
        manager.append(ids, work.prefill_counts, token_ids=work.prefill_tokens)
    else:
        ids = np.array(register_many(num) if register_many is not None else [register() for _ in work.prompts],
                       dtype=np.uint64)
        manager.append(ids, work.prefill_counts)
    batch = None
    if persistent:
        batch = SequenceBatch(manager)
        batch.extend(ids)
    prefilled = clock()
    if batch is not None:
        step = batch.step
        for tokens in decode_tokens:
            step(tokens)
    else:
        append = manager.append
        for tokens in decode_tokens:
            append(ids, token_ids=tokens)
    decoded = clock()
    used = manager.allocator.num_used_blocks
    manager.free(ids.tolist())
    freed = clock()
    if manager.prefix.hit_tokens != hits:
        raise RuntimeError("the workload's prompts are distinct: a prefix hit means a broken cache")
    return {"register+prefill": prefilled - start, "decode": decoded - prefilled, "free": freed - decoded,
            "cycle": freed - start, "blocks": used}


def run_vllm(driver: Any, work: Workload, round_index: int) -> dict[str, float]:
    """One cycle on vLLM's BlockPool, one request at a time as its scheduler does; seconds per phase."""
    clock = CLOCKS[CLOCK]
    start = clock()
    add = driver.add_request
    requests = [add(f"r{round_index}-{i}", prompt) for i, prompt in enumerate(work.prompt_lists)]
    prefilled = clock()
    decode = driver.decode
    for tokens in work.decode_lists:
        for request, token in zip(requests, tokens):
            decode(request, token)
    decoded = clock()
    used = driver.num_used_blocks()
    free = driver.free
    for request in requests:
        free(request.request_id)
    freed = clock()
    return {"register+prefill": prefilled - start, "decode": decoded - prefilled, "free": freed - decoded,
            "cycle": freed - start, "blocks": used}


def load_vllm(src: str | None) -> Any:
    """vLLM's modules from ``src``, or None (with the reason printed) when they cannot be had."""
    if not src:
        print("vLLM: no --vllm-src given (scripts/extract_vllm_core.sh extracts its files): kvpool's figures only")
        return None
    from vllm_block_pool import Vllm, missing_files

    missing = missing_files(Path(src))
    if missing:
        print(f"vLLM: {src} lacks {', '.join(missing)} (scripts/extract_vllm_core.sh): kvpool's figures only")
        return None
    return Vllm(Path(src))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-src", default=os.environ.get("VLLM_SRC"), help="extracted vLLM files ($VLLM_SRC)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=0, help="pool size (default: 2x one cycle's need)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU (as taskset -c)")
    parser.add_argument("--only", choices=("vllm", "batched", "persistent"), action="append",
                        help="run only these sides (repeatable; for profiling)")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="the figure of the rounds (min: the least disturbed round, on a busy host)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--prefix-eviction", default="lru",
                        help="kvpool's prefix eviction policies, comma-separated: the sides of each policy past the "
                             "first are named side:policy, and their cost against the first's is printed")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="what the phases are timed by: wall time, or this process's CPU time (a busy host)")
    parser.add_argument("--prefix-caching", choices=("on", "off", "both"), default="both",
                        help="the cycle with prefix caching on, off (plain block management) or both, in this order")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="cProfile kvpool's cycles (the counted rounds, its sides only): the top N by tottime")
    args = parser.parse_args()
    global CLOCK
    CLOCK = args.clock
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    num_blocks = args.num_blocks or 2 * needed_blocks(args)
    base = args.only or ["vllm", "batched", "persistent"]
    vllm = load_vllm(args.vllm_src) if "vllm" in base else None
    if vllm is None:
        base = [s for s in base if s != "vllm"]
    policies = args.prefix_eviction.split(",")
    modes = ("on", "off") if args.prefix_caching == "both" else (args.prefix_caching,)
    figures: dict[str, Any] = {}
    for mode in modes:  # the eviction policies past the first matter only with caching on
        sides = base + ([f"{s}:{p}" for p in policies[1:] for s in base if s != "vllm"] if mode == "on" else [])
        times, cached = run_mode(args, num_blocks, vllm, sides, caching=mode == "on")
        figures[mode] = report(args, num_blocks, vllm, sides, times, cached, mode)
    if "vllm" in base and len(modes) > 1:
        print("whole cycle, vLLM / kvpool: " + "; ".join(
            f"caching {m} " + ", ".join(f"{s} {figures[m]['vllm']['cycle'] / figures[m][s]['cycle']:.2f}x"
                                        for s in base if s != "vllm") for m in modes))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "num_blocks": num_blocks, f"{args.stat}_us": figures,
                                               "vllm": vllm.origin if vllm is not None else None}, indent=1))


def run_mode(args: argparse.Namespace, num_blocks: int, vllm: Any, sides: list[str],
             caching: bool) -> tuple[dict[str, list[dict[str, float]]], dict[str, int]]:
    """Every round of one mode on fresh pools (the same workloads for both modes: the rng starts at --seed); the
    rounds' figures, and the blocks each side holds in its prefix cache at the end."""
    max_len = args.max_prompt + args.decode_steps
    first_policy = args.prefix_eviction.split(",")[0]
    managers = {s: KVCacheManager(num_blocks, args.block_size, max_seq_len=max_len,
                                  max_num_seqs=max(4096, args.num_seqs),
                                  prefix_eviction=s.partition(":")[2] or first_policy) for s in sides if s != "vllm"}
    driver = None
    if vllm is not None and "vllm" in sides:
        from vllm_block_pool import VllmDriver

        driver = VllmDriver(vllm, num_blocks, args.block_size, enable_caching=caching)
    rng = np.random.default_rng(args.seed)
    profile = cProfile.Profile() if args.profile else None
    times: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    for r in range(args.rounds + 1):  # round 0 warms up
        work = Workload(args, rng)
        order = sides if r % 2 == 0 else sides[::-1]
        blocks = set()
        for side in order:
            gc.collect()
            if side == "vllm":
                result = run_vllm(driver, work, r)
            else:
                if profile is not None and r:
                    profile.enable()
                result = run_kvpool(managers[side], work, side.startswith("persistent"), caching)
                if profile is not None:
                    profile.disable()
            blocks.add(result["blocks"])
            if r:
                times[side].append(result)
        if len(blocks) != 1:
            raise RuntimeError(f"the sides disagree on the blocks in use after decode: {sorted(blocks)}")
    for manager in managers.values():
        manager.check_invariants()
    if profile is not None:
        print(f"kvpool's cycles, prefix caching {'on' if caching else 'off'} (cProfile; its timings inflate the figures):")
        pstats.Stats(profile).strip_dirs().sort_stats("tottime").print_stats(args.profile)
    cached = {s: m.allocator.cache.num_cached for s, m in managers.items()}
    if driver is not None:
        cached["vllm"] = driver.num_cached_blocks()
    return times, cached


def report(args: argparse.Namespace, num_blocks: int, vllm: Any, sides: list[str],
           times: dict[str, list[dict[str, float]]], cached: dict[str, int], mode: str) -> dict[str, dict[str, float]]:
    stat = statistics.median if args.stat == "median" else min
    medians = {s: {p: stat(t[p] for t in times[s]) * 1e6 for p in PHASES} for s in sides}
    print(f"{args.num_seqs} sequences, prompts {args.min_prompt}-{args.max_prompt} tokens, {args.decode_steps} decode "
          f"steps, block size {args.block_size}, pool {num_blocks} blocks, prefix caching {mode}; {args.stat} of "
          f"{args.rounds} rounds, us per cycle" + (f"; vLLM from {vllm.origin}" if vllm is not None else ""))
    header = f"{'phase':<18}" + "".join(f"{s:>16}" for s in sides)
    if "vllm" in sides:
        header += "".join(f"{'vLLM/' + s:>20}" for s in sides if s != "vllm")
    print(header)
    for phase in PHASES:
        line = f"{phase:<18}" + "".join(f"{medians[s][phase]:>16,.0f}" for s in sides)
        if "vllm" in sides:
            line += "".join(f"{medians['vllm'][phase] / medians[s][phase]:>19.2f}x" for s in sides if s != "vllm")
        print(line)
    per_step = {s: medians[s]["decode"] / args.decode_steps for s in sides}
    print("decode step (all sequences): " + ", ".join(f"{s} {per_step[s]:.1f} us" for s in sides))
    print(f"cached blocks (prefix caching {mode}): " + ", ".join(f"{s} {cached[s]}" for s in sides))
    for s in sides:
        base, _, policy = s.partition(":")
        if policy:  # the same side under the first policy: the cost of this one
            first = args.prefix_eviction.split(",")[0]
            print(f"{s} / {base} ({first}): decode step {per_step[s] / per_step[base]:.3f}, "
                  f"whole cycle {medians[s]['cycle'] / medians[base]['cycle']:.3f}")
    print()
    return medians


if __name__ == "__main__":
    main()
