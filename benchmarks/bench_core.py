"""In-process decode-loop benchmark of the core (no gRPC, no device): token-appends per second.

256 concurrent sequences, 16-token blocks, the seed's lengths (prompt 4-32, target 32-256 tokens), a completed
sequence is freed and replaced at once, and the slot mapping of every token is produced. Three modes, each measured
twice in one run: one ``manager.append(seq_id)`` call per sequence per step (the per-sequence baseline), one
``manager.append(seq_ids)`` call per step for all sequences (what the server runs for an AppendToken), and one
``SequenceBatch.step()`` per step (persistent_batch.py: rows resolved once, kept between steps).

    python benchmarks/bench_core.py [--seconds 3] [--concurrency 256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvpool_server.core import KVCacheManager
from persistent_batch import SequenceBatch

BLOCK_SIZE = 16
NUM_BLOCKS = 32768  # a 256 MiB pool of 8 KiB blocks (16 tokens x 128 float32)


class Workload:
    """Keeps ``concurrency`` sequences decoding; replaces each one that reaches its target length.

    Like a scheduler it knows when each sequence will finish (``finishing``: step -> batch positions), so
    retiring costs one dict lookup a step, not a scan of the batch.
    """

    def __init__(self, manager: KVCacheManager, concurrency: int, seed: int, persistent: bool) -> None:
        self.manager = manager
        self.batch = SequenceBatch(manager) if persistent else None
        self.rng = np.random.default_rng(seed)
        self.seq_ids = np.zeros(concurrency, dtype=np.uint64)  # what a batched append takes
        self.seq_id_list: list[int] = [0] * concurrency  # the same ids as Python ints
        self.step = 0
        self.finishing: dict[int, list[int]] = {}
        self.tokens = 0
        # Lengths are drawn up front so that the random draws are not timed.
        self._prompts = self.rng.integers(4, 33, size=1 << 20).tolist()
        self._targets = self.rng.integers(32, 257, size=1 << 20).tolist()
        self._next = 0
        for i in range(concurrency):
            self._start(i)

    def _start(self, i: int) -> None:
        prompt, target = self._prompts[self._next], self._targets[self._next]
        self._next += 1
        seq_id = self.manager.register()
        self.manager.append(seq_id, prompt)
        self.tokens += prompt
        if self.batch is not None:
            if len(self.batch) < self.seq_ids.size:
                self.batch.add(seq_id)
            else:
                self.batch.replace(self.seq_id_list[i], seq_id)
        self.seq_ids[i] = seq_id
        self.seq_id_list[i] = seq_id
        done = self.step + max(target - prompt, 1)
        if done in self.finishing:
            self.finishing[done].append(i)
        else:
            self.finishing[done] = [i]

    def retire_finished(self) -> None:
        """After a decode step: free the sequences that reached their target (one call) and start new ones."""
        self.step += 1
        finished = self.finishing.pop(self.step, None)
        if finished:
            self.manager.free([self.seq_id_list[i] for i in finished])
            for i in finished:
                self._start(i)


def run(mode: str, seconds: float, concurrency: int, seed: int) -> tuple[float, int]:
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, max_seq_len=4096)
    work = Workload(manager, concurrency, seed, persistent=mode == "persistent")
    work.tokens = 0
    checksum = 0
    start = time.perf_counter()
    deadline = start + seconds
    steps = 0
    while True:
        if mode == "per-sequence":
            append = manager.append
            for seq_id in work.seq_id_list:
                checksum += int(append(seq_id).slot_mapping[0])
        elif mode == "batched":
            plan = manager.append(work.seq_ids)
            checksum += int(plan.slot_mapping[-1])
        else:
            plan = work.batch.step()
            checksum += int(plan.slot_mapping[-1])
        work.tokens += concurrency
        work.retire_finished()
        steps += 1
        if steps % 64 == 0 and time.perf_counter() > deadline:
            break
    elapsed = time.perf_counter() - start
    manager.check_invariants()
    return work.tokens / elapsed, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = {}
    for mode in ("per-sequence", "batched", "persistent", "per-sequence", "batched", "persistent"):
        rate, steps = run(mode, args.seconds, args.concurrency, args.seed)
        results.setdefault(mode, []).append(rate)
        print(f"{mode:>13}: {rate / 1e6:6.2f} M token-appends/s  ({steps} steps of {args.concurrency} sequences)")
    per_seq, batched, persistent = (max(results[m]) for m in ("per-sequence", "batched", "persistent"))
    print(f"best of 2: per-sequence {per_seq / 1e6:.2f} M/s, batched {batched / 1e6:.2f} M/s "
          f"({batched / per_seq:.1f}x), persistent batch {persistent / 1e6:.2f} M/s ({persistent / per_seq:.1f}x)")


if __name__ == "__main__":
    main()
