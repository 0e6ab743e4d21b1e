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


def test_without_vllm_prints_kvpool_alone(tmp_path: Path) -> None:
    out = run("--vllm-src", str(tmp_path))
    assert "lacks vllm/utils/hashing.py" in out and "kvpool's figures only" in out, out
    for phase in ("register+prefill", "decode", "free", "cycle"):
        assert re.search(rf"^{re.escape(phase)}\s+[\d,]+\s+[\d,]+$", out, re.M), out
    assert "vllm" not in out.splitlines()[-6], out  # the header: batched and persistent only


@needs_vllm
def test_with_vllm_prints_ratios_and_the_sides_agree_on_blocks() -> None:
    # run() raises on a non-zero exit: the script fails when the sides hold different numbers of blocks
    out = run("--vllm-src", str(VLLM_SRC))
    for phase in ("register+prefill", "decode", "free", "cycle"):
        assert re.search(rf"^{re.escape(phase)}\s+([\d,]+\s+){{3}}[\d.]+x\s+[\d.]+x$", out, re.M), out


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
