"""KV-aware routing across kvpool hosts from the published events alone, against round-robin (docs/scale-out.md).

K real ``kvpool-server`` processes (host pools, ``--kv-events-publish ipc://...``), and in this process a router
written to the contract, not to kvpool's code: one ZMQ SUB socket per server, each message decoded as llm-d decodes
it (tests/zmq_events/zmq_consumer.py), and, as llm-d's indexer does, its own block keys computed from each
BlockStored's token ids chained from the parent's key (the engine keys only name blocks for BlockRemoved and for
parents). A request is scored on each server by the longest run of its prompt's full blocks that server holds,
and sent to the best (ties: the server with the fewest requests so far); round-robin ignores the events.

Workload (shared prefixes): ``--prefixes`` system prompts of ``--prefix-blocks`` blocks, each request one of them
(Zipf-like popularity) plus a unique question of 1-3 blocks; the frontend registers the prompt (the server answers
how many tokens it had cached: the hit), appends the rest with ids and one decode token (sealing), and frees it
(its blocks stay cached until evicted). Each server's pool is too small for every prefix, so where a prefix's
requests go decides how often it is found. Printed: the prefix hit rate (cached tokens / prompt tokens) of each
policy, the requests per server, and the ceiling (one pool holding every prefix: each prefix misses once).
Run: ``.venv/bin/python benchmarks/sim_kv_routing.py`` (about a minute; needs pyzmq and msgpack).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_service_servers import Server  # noqa: E402  (this directory)

from kvpool_client import KVPoolClient  # noqa: E402
from tests.zmq_events.zmq_consumer import Subscriber, decode_like_llmd  # noqa: E402

BLOCK_SIZE = 16
MODEL = "sim-model"


def own_key(parent: bytes, tokens: list[int]) -> bytes:
    """The router's key of a block: its own chained hash of token ids (as llm-d computes request keys)."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype="<u4").tobytes(), digest_size=16).digest()


class HostIndex:
    """One server's blocks, as the router knows them from its events: own key per engine key, and the set of own
    keys held."""

    def __init__(self) -> None:
        self.key_of: dict[int, bytes] = {}
        self.held: set[bytes] = set()

    def apply(self, events: list[tuple]) -> None:
        for event in events:
            if event[0] == "AllBlocksCleared":
                self.key_of.clear()
                self.held.clear()
            elif event[0] == "BlockStored":
                _, hashes, parent, tokens, block_size, _ = event
                parent_key = b"" if not parent else self.key_of.get(parent)
                if parent_key is None:
                    continue  # a parent never seen: skipped, as llm-d does
                for i, h in enumerate(hashes):
                    parent_key = own_key(parent_key, tokens[i * block_size: (i + 1) * block_size])
                    self.key_of[h] = parent_key
                    self.held.add(parent_key)
            elif event[0] == "BlockRemoved":
                for h in event[1]:
                    key = self.key_of.pop(h, None)
                    if key is not None:
                        self.held.discard(key)

    def score(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return n


def prompt_keys(prompt: list[int]) -> list[bytes]:
    keys, parent = [], b""
    for start in range(0, len(prompt) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = own_key(parent, prompt[start: start + BLOCK_SIZE])
        keys.append(parent)
    return keys


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    prefixes = [rng.integers(0, 30_000, args.prefix_blocks * BLOCK_SIZE).tolist() for _ in range(args.prefixes)]
    weights = 1.0 / np.arange(1, args.prefixes + 1) ** args.zipf
    weights /= weights.sum()
    requests = []
    for _ in range(args.requests):
        prefix = prefixes[rng.choice(args.prefixes, p=weights)]
        question = rng.integers(30_000, 60_000, int(rng.integers(1, 4)) * BLOCK_SIZE + 5).tolist()
        requests.append(prefix + question)
    return requests


def run(policy: str, args: argparse.Namespace, requests: list[list[int]]) -> dict:
    ipc = tempfile.mkdtemp(prefix="kvz-", dir="/tmp")
    servers, subs, clients = [], [], []
    try:
        for k in range(args.servers):
            endpoint = f"ipc://{ipc}/pub{k}"
            servers.append(Server("kvpool", ["--num-blocks", str(args.num_blocks), "--block-size", str(BLOCK_SIZE),
                                             "--kv-events-publish", endpoint, "--kv-events-model", MODEL,
                                             "--kv-events-pod", f"host-{k}"], transport="unix"))
            subs.append(Subscriber(endpoint))
            clients.append(KVPoolClient(servers[-1].address, session=False, timeout=30))
        hosts = [HostIndex() for _ in servers]
        counts = [0] * len(servers)
        hit = total = 0
        for i, prompt in enumerate(requests):
            for sub, host in zip(subs, hosts, strict=True):  # what has arrived by now (the router lags, as it would)
                while (message := sub.recv(0.0)) is not None:
                    host.apply(decode_like_llmd(message.payload))
            if policy == "round-robin":
                k = i % len(servers)
            else:
                keys = prompt_keys(prompt)
                scores = [host.score(keys) for host in hosts]
                best = max(scores)
                k = min((c, j) for j, c in enumerate(counts) if scores[j] == best)[1]
            counts[k] += 1
            client = clients[k]
            seq, cached = client.register_prompt(prompt)
            client.append(seq, len(prompt) - cached, token_ids=prompt[cached:])
            client.append(seq, 1, token_ids=[1])  # one decode step: seals the prompt's blocks
            client.free(seq)
            hit += cached
            total += len(prompt) // BLOCK_SIZE * BLOCK_SIZE
            time.sleep(args.gap_ms / 1000)
        return {"hit_rate": hit / total, "counts": counts}
    finally:
        for client in clients:
            client.close()
        for sub in subs:
            sub.close()
        for server in servers:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=160, help="each server's pool, in blocks")
    parser.add_argument("--prefixes", type=int, default=12)
    parser.add_argument("--prefix-blocks", type=int, default=24)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--zipf", type=float, default=0.8, help="prefix popularity: weight 1/rank**zipf")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="pause between requests (events arrive meanwhile)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    requests = workload(args)
    print(f"{args.servers} kvpool servers x {args.num_blocks} blocks of {BLOCK_SIZE} tokens; {args.requests} requests "
          f"over {args.prefixes} shared prefixes of {args.prefix_blocks} blocks (zipf {args.zipf}) + 1-3 blocks each")
    seen: set[tuple[int, ...]] = set()
    ceiling = 0
    for prompt in requests:  # one pool large enough for everything: every prefix after its first request
        prefix = tuple(prompt[: args.prefix_blocks * BLOCK_SIZE])
        ceiling += len(prefix) if prefix in seen else 0
        seen.add(prefix)
    full = sum(len(p) // BLOCK_SIZE * BLOCK_SIZE for p in requests)
    print(f"  {'ceiling':12s} prefix hit rate {ceiling / full:6.1%}   (one pool that holds every prefix)")
    for policy in ("round-robin", "kv-aware"):
        got = run(policy, args, requests)
        print(f"  {policy:12s} prefix hit rate {got['hit_rate']:6.1%}   requests per server {got['counts']}")


if __name__ == "__main__":
    main()
