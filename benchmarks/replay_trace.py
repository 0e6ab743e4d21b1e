"""Replay a request trace through kvpool's own core (issue 34): the token hit rate of the prefix cache's eviction
policy at a given pool size.

    .venv/bin/python benchmarks/replay_trace.py --trace conversation_trace.jsonl --capacity-blocks 1500 --policy lrfu

The trace is Mooncake's format, one JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length``
(tokens), ``hash_ids`` (one per ``--hash-block-tokens`` tokens of the prompt, chained: two prompts share a leading
run of ids exactly where they share a prefix; the last may be partial). Each id becomes that many synthetic token
ids, equal exactly where the ids are equal, so the core hashes, seals and matches them as it would real tokens.

Requests are served in timestamp order through a ``KVCacheManager`` of ``--capacity-blocks`` x
``--hash-block-tokens`` tokens (in blocks of ``--block-size``): register with the prompt (the core matches the
longest cached run of its full blocks, the last token always recomputed), prefill the rest with its token ids,
decode one token without ids (which seals the prompt's blocks; ``--hold-output``: ``output_length`` tokens; a
request that gives its output's ids decodes them, then one token more to seal them), and free once ``--concurrency`` newer requests are in flight (1: at once). With ``--host-tier-blocks`` the pool's
evictions spill into a host tier and a register first restores what the tier holds of its prompt, as the service
does (copies are bookkeeping here: nothing moves). A request that needs more blocks than are free makes the oldest
in flight finish first; one that needs more than the whole pool is skipped (counted).

The last line: ``token hit rate <x.xx>% (policy <name>, capacity <N> x 512-token blocks)``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool_server.core.errors import OutOfBlocksError
from kvpool_server.core.eviction_policy import PREFIX_EVICTION_POLICIES
from kvpool_server.core.manager import KVCacheManager
from kvpool_server.offload import restore
from kvpool_server.offload.host_tier import HostTier, StorePlan


@dataclass(frozen=True)
class Request:
    """One request: its prompt's token ids, how many tokens it decodes, and their ids (None: decoded without ids,
    so never cached; the trace's case -- its next turns carry their own hash ids)."""

    prompt: np.ndarray
    output_len: int
    output_ids: np.ndarray | None = None


def load_trace(path: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The trace's records in timestamp order (stable: ties keep the file's order)."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    records.sort(key=lambda r: r["timestamp"])
    return records[:limit] if limit is not None else records


def trace_requests(records: Iterable[dict[str, Any]], hash_block_tokens: int = 512) -> Iterator[Request]:
    """Each record as a Request: hash id h at position j of its block is token ``h * hash_block_tokens + j``
    (equal exactly where the ids are equal), the prompt cut to ``input_length``."""
    offsets = np.arange(hash_block_tokens, dtype=np.uint64)
    for r in records:
        ids = np.asarray(r["hash_ids"], dtype=np.uint64)
        tokens = (ids[:, None] * np.uint64(hash_block_tokens) + offsets).reshape(-1)[: r["input_length"]]
        yield Request((tokens & np.uint64(0xFFFFFFFF)).astype(np.uint32), int(r["output_length"]))


@dataclass
class ReplayResult:
    requests: int = 0
    skipped: int = 0  # needed more blocks than the whole pool
    prompt_tokens: int = 0
    hit_tokens: int = 0  # found cached: in the pool or restored from the host tier
    host_hit_tokens: int = 0  # of them restored from the host tier
    evicted_blocks: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Replay:
    """Serves Requests through ``manager`` (module docstring): register, prefill, decode, free."""

    def __init__(self, manager: KVCacheManager, tier: HostTier | None, concurrency: int = 1, hold_output: bool = False,
                 check_every: int = 0) -> None:
        self.manager = manager
        self.tier = tier  # the host tier over ``manager`` (None: none)
        self.concurrency = concurrency
        self.hold_output = hold_output
        self.check_every = check_every
        self.inflight: deque[int] = deque()
        self.result = ReplayResult()

    def store(self, plan: StorePlan) -> None:
        """A store plan of the host tier, run and committed (the service's ``TierCopies.run_stores``; no bytes)."""
        if len(plan.pairs):
            self.tier.commit(plan.pairs[:, 1].tolist())  # type: ignore[union-attr]

    def append(self, seq_id: int, num: int, token_ids: np.ndarray | None) -> bool:
        """Append, making the oldest requests in flight finish while the blocks are not free. False: the pool
        cannot hold it even empty of other requests."""
        while True:
            try:
                plan = self.manager.append(seq_id, num, token_ids=token_ids)
                if self.tier is not None:  # the plan's evictions, stored as the service stores them
                    self.store(self.tier.prepare_store(plan.evicted))
                return True
            except OutOfBlocksError:
                if not self.inflight:
                    return False
                self.manager.free(self.inflight.popleft())

    def serve(self, request: Request) -> None:
        m, result, prompt = self.manager, self.result, request.prompt
        if self.tier is not None:
            staged = restore.stage_prompt(self.tier, None, prompt)
            if staged is not None:
                self.store(staged.stores)
                result.host_hit_tokens += restore.finish(self.tier, staged, True) * m.block_size
        seq_id = m.register(prompt_token_ids=prompt)
        cached = m.num_tokens(seq_id)
        output = max(1, request.output_len) if self.hold_output or request.output_ids is not None else 1
        if not (self.append(seq_id, prompt.size - cached, prompt[cached:])
                and self.append(seq_id, output, request.output_ids)
                and (request.output_ids is None or self.append(seq_id, 1, None))):  # seals the output's blocks
            m.free(seq_id)
            result.skipped += 1
            return
        result.requests += 1
        self.inflight.append(seq_id)
        while len(self.inflight) >= self.concurrency:
            m.free(self.inflight.popleft())
        if self.check_every and result.requests % self.check_every == 0:
            m.check_invariants()

    def run(self, requests: Iterable[Request]) -> ReplayResult:
        start = time.perf_counter()
        for request in requests:
            self.serve(request)
        while self.inflight:
            self.manager.free(self.inflight.popleft())
        if self.check_every:
            self.manager.check_invariants()
        m, result = self.manager, self.result
        result.prompt_tokens, result.hit_tokens = m.prefix.query_tokens, m.prefix.hit_tokens
        result.evicted_blocks = m.allocator.cache.num_evicted
        result.seconds = time.perf_counter() - start
        return result


def make_manager(num_blocks: int, block_size: int, max_seq_len: int, policy: str, concurrency: int,
                 host_tier_blocks: int = 0) -> tuple[KVCacheManager, HostTier | None]:
    manager = KVCacheManager(num_blocks, block_size, max_seq_len=max_seq_len, max_num_seqs=concurrency + 2,
                             prefix_eviction=policy)
    return manager, HostTier(manager, host_tier_blocks) if host_tier_blocks else None


def replay(requests: list[Request], num_blocks: int, block_size: int, policy: str, concurrency: int = 1,
           hold_output: bool = False, host_tier_blocks: int = 0, check_every: int = 0) -> ReplayResult:
    """One replay of ``requests`` through a fresh manager of ``num_blocks`` blocks of ``block_size`` tokens."""
    longest = max(r.prompt.size + max(1, r.output_len) for r in requests)
    max_seq_len = -(-(longest + 1) // block_size) * block_size
    manager, tier = make_manager(num_blocks, block_size, max_seq_len, policy, concurrency, host_tier_blocks)
    return Replay(manager, tier, concurrency, hold_output, check_every).run(requests)


def report(result: ReplayResult, block_size: int, tier: bool) -> list[str]:
    n = max(1, result.requests)
    pool = (result.hit_tokens - result.host_hit_tokens) / max(1, result.prompt_tokens)
    lines = [f"requests {result.requests} (skipped {result.skipped}), prompt tokens {result.prompt_tokens}, "
             f"{result.seconds:.1f} s",
             f"hit tokens by tier: pool {100 * pool:.2f}%"
             + (f", host tier {100 * result.host_hit_tokens / max(1, result.prompt_tokens):.2f}%" if tier else ""),
             f"eviction work: {result.evicted_blocks / n:.1f} blocks of {block_size} tokens evicted per request"]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="the trace, JSON lines (the module docstring)")
    p.add_argument("--capacity-blocks", type=int, required=True, help="the pool, in --hash-block-tokens blocks")
    p.add_argument("--policy", default="lru", choices=PREFIX_EVICTION_POLICIES, help="the prefix eviction policy")
    p.add_argument("--block-size", type=int, default=16, help="the pool's block size in tokens")
    p.add_argument("--hash-block-tokens", type=int, default=512, help="tokens per hash id of the trace")
    p.add_argument("--concurrency", type=int, default=1, help="requests held at once (1: each freed at once)")
    p.add_argument("--hold-output", action="store_true", help="decode output_length tokens while held")
    p.add_argument("--host-tier-blocks", type=int, default=0, help="a host tier of this many --hash-block-tokens blocks")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--check-every", type=int, default=0, help="check the core's invariants every N requests")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.hash_block_tokens % args.block_size:
        p.error("--hash-block-tokens must be a multiple of --block-size")
    per = args.hash_block_tokens // args.block_size
    requests = list(trace_requests(load_trace(args.trace, args.limit), args.hash_block_tokens))
    result = replay(requests, args.capacity_blocks * per, args.block_size, args.policy, args.concurrency,
                    args.hold_output, args.host_tier_blocks * per, args.check_every)
    for line in report(result, args.block_size, bool(args.host_tier_blocks)):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**vars(args), **result.__dict__, "hit_rate": result.hit_rate}, f, indent=1)
    print(f"token hit rate {100 * result.hit_rate:.2f}% (policy {args.policy}, capacity {args.capacity_blocks} x "
          f"{args.hash_block_tokens}-token blocks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
