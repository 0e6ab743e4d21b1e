"""kvpool-loadgen end to end: its own processes against a real kvpool-server, one run per mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_client import KVPoolClient

POOL = ("--backend", "host", "--pool-bytes", "8MiB")  # 1,024 blocks of the seed layout
# The same token size split over 4 KV heads, as a tensor-parallel group of 1, 2 or 4 ranks (N pools split by heads;
# the load generator writes every rank's heads through its own mapping and verifies them there and by ReadKV).
TENSOR_PARALLEL = [1, 2, 4]


def tp_pool(n: int) -> tuple[str, ...]:
    if n == 1:
        return POOL
    return (*POOL, "--num-kv-heads", "4", "--head-dim", "16", "--tensor-parallel", str(n))


def loadgen(target: str, tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    script = Path(sys.executable).with_name("kvpool-loadgen")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvpool_client.loadgen.main"]
    json_path = tmp_path / "summary.json"
    out = subprocess.run(
        cmd + ["--target", target, "--json", str(json_path), "--no-progress", *args],
        capture_output=True, text=True, timeout=120,
    )
    summary = json.loads(json_path.read_text()) if json_path.exists() else {}
    return out.returncode, summary, out.stdout + out.stderr


def assert_clean_run(rc: int, summary: dict, output: str, completions: int, target: str) -> None:
    assert rc == 0, output
    assert summary["ok"] and summary["run"]["completions"] == completions
    assert summary["verification"]["errors"] == 0
    assert summary["verification"]["tokens_verified"] >= summary["run"]["tokens_appended"]
    assert summary["end"]["blocks_used"] == 0 and summary["end"]["sequences"] == 0
    assert summary["end"]["invariants_ok"]
    assert summary["memory"]["peak_used_blocks"] > 0
    assert "KV verification errors          0" in output
    with KVPoolClient(target) as client:  # the server agrees: everything free, invariants clean
        stats = client.stats()
        assert stats.num_blocks_free == stats.num_blocks_total and stats.num_sequences == 0
        assert client.check_invariants().ok


SMALL = ("--processes", "2", "--concurrency", "4", "--completions", "10", "--max-len", "80", "--seed", "3")


@pytest.mark.parametrize("tp", TENSOR_PARALLEL)
def test_plain_mode(server_factory, tmp_path, tp):
    server = server_factory(*tp_pool(tp))
    rc, summary, output = loadgen(server.address, tmp_path, *SMALL)
    assert_clean_run(rc, summary, output, 10, server.address)
    assert summary["run"]["sequences"] == 10
    assert summary["sharing"]["copies"] == 0 and summary["sharing"]["forks"] == 0
    # Plain requests: every token but the prompt is one decode step of one AppendToken per process and step.
    assert summary["run"]["append_calls"] == summary["run"]["decode_steps"] + 10
    assert 0 < summary["memory"]["paged_over_naive_peak"] < 1
    assert summary["memory"]["external_fragmentation"] == 0.0


@pytest.mark.parametrize("tp", TENSOR_PARALLEL)
def test_beam_mode_forks_prunes_and_copies_on_write(server_factory, tmp_path, tp):
    server = server_factory(*tp_pool(tp))
    rc, summary, output = loadgen(server.address, tmp_path, *SMALL, "--mode", "beam", "--beam-width", "4")
    assert_clean_run(rc, summary, output, 10, server.address)
    share = summary["sharing"]
    assert summary["run"]["beams_pruned"] > 0 and share["forks"] > 10 * 3
    assert share["copies"] > 0 and share["copies"] == share["copies_server"]
    assert 0.2 < share["blocks_saved_avg"] < 1
    assert "blocks saved vs no sharing" in output


def test_parallel_mode_shares_the_prompt(server_factory, tmp_path):
    server = server_factory(*POOL)
    rc, summary, output = loadgen(
        server.address, tmp_path, *SMALL, "--mode", "parallel", "--num-samples", "3", "--lengths", "sharegpt"
    )
    assert_clean_run(rc, summary, output, 10, server.address)
    share = summary["sharing"]
    assert summary["run"]["sequences"] == 30 and share["forks"] == 20
    assert share["copies"] > 0 and share["blocks_saved_avg"] > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_injected_corruption_is_caught_and_fails_the_run(server_factory, tmp_path, tp):
    server = server_factory(*tp_pool(tp))
    rc, summary, output = loadgen(server.address, tmp_path, *SMALL, "--inject-errors", "2")
    assert rc == 1, output
    assert not summary["ok"]
    assert summary["verification"]["errors_injected"] == 2
    # One bad token per corrupted sequence, seen both through the page table and through ReadKV.
    assert summary["verification"]["errors"] == 4
    assert summary["verification"]["checks_failed"] == 4
    assert "result: FAIL" in output


def test_no_server_is_exit_2(tmp_path):
    rc, _, output = loadgen(f"unix:{tmp_path}/nobody.sock", tmp_path, "--timeout", "1")
    assert rc == 2 and "kvpool-loadgen:" in output


@pytest.mark.parametrize("bad", [["--concurrency", "0"], ["--max-len", "20"], ["--inject-errors", "-1"]])
def test_bad_arguments_are_refused(bad, tmp_path):
    rc, _, output = loadgen("unix:/nonexistent", tmp_path, *bad)
    assert rc == 2 and "error" in output
