"""benchmarks/bench_vs_vllm.py runs with and without vLLM's files and prints every phase (nothing here is timed).

Without vLLM's files (CI: vLLM is not a dependency) the script prints kvpool's figures and says why; the cases that
load vLLM's BlockPool run where VLLM_SRC names a folder extracted by scripts/extract_vllm_core.sh.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SMALL = ("--num-seqs", "16", "--min-prompt", "5", "--max-prompt", "40", "--decode-steps", "20", "--rounds", "1")
VLLM_SRC = os.environ.get("VLLM_SRC")
needs_vllm = pytest.mark.skipif(not VLLM_SRC, reason="VLLM_SRC (vLLM's extracted files) not set")


def run(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SRC"}
    result = subprocess.run([sys.executable, "bench_vs_vllm.py", *SMALL, *args], cwd=BENCHMARKS, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def sections(out: str) -> dict[str, str]:
    """The output of each mode ("on", "off"), from its "prefix caching X" title to its blank line."""
    found = dict(re.findall(r"prefix caching (on|off);.*?\n(.*?)\n\n", out, re.S))
    assert found, out
    return found


def cached_blocks(section: str) -> dict[str, int]:
    line = re.search(r"^cached blocks \(prefix caching \w+\): (.*)$", section, re.M)
    assert line, section
    return {side: int(n) for side, n in (part.split() for part in line.group(1).split(", "))}


def test_without_vllm_prints_kvpool_alone(tmp_path: Path) -> None:
    out = run("--vllm-src", str(tmp_path))
    assert "lacks vllm/utils/hashing.py" in out and "kvpool's figures only" in out, out
    for section in sections(out).values():
        assert section.splitlines()[0].split() == ["phase", "batched", "persistent"], out
        for phase in ("register+prefill", "decode", "free", "cycle"):
            assert re.search(rf"^{re.escape(phase)}\s+[\d,]+\s+[\d,]+$", section, re.M), out


def test_both_modes_by_default_and_caching_off_caches_nothing(tmp_path: Path) -> None:
    out = sections(run("--vllm-src", str(tmp_path)))
    assert set(out) == {"on", "off"}
    on, off = cached_blocks(out["on"]), cached_blocks(out["off"])
    assert set(on) == set(off) == {"batched", "persistent"}
    assert all(n > 0 for n in on.values()), on  # caching on: the prompts' and the decode's full blocks
    assert all(n == 0 for n in off.values()), off  # off: no token ids, so nothing sealed
    assert set(sections(run("--vllm-src", str(tmp_path), "--prefix-caching", "off"))) == {"off"}


@needs_vllm
def test_with_vllm_prints_ratios_and_the_sides_agree_on_blocks() -> None:
    # run() raises on a non-zero exit: the script fails when the sides hold different numbers of blocks
    out = run("--vllm-src", str(VLLM_SRC))
    for mode, section in sections(out).items():
        for phase in ("register+prefill", "decode", "free", "cycle"):
            assert re.search(rf"^{re.escape(phase)}\s+([\d,]+\s+){{3}}[\d.]+x\s+[\d.]+x$", section, re.M), out
        cached = cached_blocks(section)
        assert (cached["vllm"] > 0) == (mode == "on") and (cached["batched"] > 0) == (mode == "on"), out
    assert re.search(r"^whole cycle, vLLM / kvpool: caching on batched [\d.]+x, persistent [\d.]+x; "
                     r"caching off batched [\d.]+x, persistent [\d.]+x$", out, re.M), out


@needs_vllm
def test_vllm_driver_without_caching_hashes_and_caches_nothing() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    from vllm_block_pool import Vllm, VllmDriver

    driver = VllmDriver(Vllm(Path(str(VLLM_SRC))), num_blocks=32, block_size=4, enable_caching=False)
    assert driver.pool.enable_caching is False and driver.hasher is None
    first = driver.add_request("a", list(range(10)))
    for token in (10, 11):
        driver.decode(first, token)
    assert first.block_hashes == [] and driver.num_used_blocks() == 3 and driver.num_cached_blocks() == 0
    blocks = [b.block_id for b in driver.req_to_blocks["a"]]
    driver.free("a")
    second = driver.add_request("b", list(range(13)))  # the same prompt start: no hit, 4 blocks, the freed first
    assert driver.num_used_blocks() == 4 and second.block_hashes == []
    assert {b.block_id for b in driver.req_to_blocks["b"][:3]} == set(blocks)  # LIFO reuse of uncached blocks


@needs_vllm
def test_vllm_driver_caches_full_blocks_and_hits_them() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    from vllm_block_pool import Vllm, VllmDriver

    driver = VllmDriver(Vllm(Path(str(VLLM_SRC))), num_blocks=32, block_size=4)
    first = driver.add_request("a", list(range(10)))  # 2 full blocks hashed and cached, 3 blocks in all
    assert len(first.block_hashes) == 2 and driver.num_used_blocks() == 3
    for token in (10, 11):  # fills the third block: hashed and cached
        driver.decode(first, token)
    assert len(first.block_hashes) == 3 and driver.num_cached_block["a"] == 3
    second = driver.add_request("b", list(range(13)))  # hits the 3 cached blocks, one new block for token 12
    assert driver.req_to_blocks["b"][:3] == driver.req_to_blocks["a"]
    assert driver.num_used_blocks() == 4
    driver.free("a")
    driver.free("b")
    assert driver.num_used_blocks() == 0 and second.num_tokens == 13
