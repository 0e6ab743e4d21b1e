"""benchmarks/replay_trace.py on tiny synthetic traces written here: the hit counts are the hand-computed ones (the
real core serving them); replay_sweep.py prints its table. Nothing is timed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.benchmarks.test_benchmarks_run import run_script


def write_trace(path: Path, records: list[tuple[int, int, list[int]]]) -> str:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 5, "hash_ids": ids}) + "\n"
                            for t, n, ids in records))
    return str(path)


def replay(*args: str) -> tuple[str, float]:
    out = run_script("replay_trace.py", "--hash-block-tokens", "32", "--check-every", "1", *args, timeout=120)
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(r"token hit rate (\d+\.\d\d)% \(policy (\w+), capacity (\d+) x 32-token blocks\)", last)
    assert match, out
    return out, float(match.group(1))


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
def test_hits_are_the_longest_cached_runs_last_token_recomputed(tmp_path: Path, policy: str) -> None:
    # 32-token hash blocks = 2 pool blocks of 16. Served in timestamp order: [1,2] 64 tokens (no hit, 4 blocks
    # cached); [1,2,3] 96 tokens: 4 blocks hit = 64; [1,2] 64 (ts 20): (64-1)//16 = 3 blocks = 48; [1,4] 40:
    # hash 1's 2 blocks = 32. 144 of 264 tokens.
    trace = write_trace(tmp_path / "t.jsonl", [(0, 64, [1, 2]), (10, 96, [1, 2, 3]), (30, 40, [1, 4]), (20, 64, [1, 2])])
    out, rate = replay("--trace", trace, "--capacity-blocks", "100", "--policy", policy)
    assert rate == round(100 * 144 / 264, 2) and f"policy {policy}" in out
    assert "requests 4 (skipped 0), prompt tokens 264" in out


def test_evictions_and_the_host_tier(tmp_path: Path) -> None:
    # 6 pool blocks. [1,2] caches 4 blocks (+1 decode block); [5,6] needs 5: evicts [1,2]'s last 3 (tail first),
    # keeping hash 1's first block; [1,2] again: 16 tokens hit. With a host tier of 8 slots the 3 evicted blocks
    # are restored: 16 + 32 = 48.
    trace = write_trace(tmp_path / "e.jsonl", [(0, 64, [1, 2]), (1, 64, [5, 6]), (2, 64, [1, 2])])
    _, rate = replay("--trace", trace, "--capacity-blocks", "3")
    assert rate == round(100 * 16 / 192, 2)
    out, rate = replay("--trace", trace, "--capacity-blocks", "3", "--host-tier-blocks", "4")
    assert rate == 25.0 and "pool 8.33%, host tier 16.67%" in out


def test_sweep_prints_a_row_per_capacity(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [(0, 64, [1, 2]), (1, 96, [1, 2, 3])])
    out = run_script("replay_sweep.py", "--trace", trace, "--hash-block-tokens", "32", "--capacities", "3,100",
                     "--json", str(tmp_path / "s.json"), timeout=120)
    assert re.search(r"^\s+100\s+40\.00%\s+40\.00%$", out, re.M), out
    assert len(json.loads((tmp_path / "s.json").read_text())["rows"]) == 4
