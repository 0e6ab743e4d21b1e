"""kvpool-loadgen's fail-fast checks and its explanation of an incomplete run, against real servers."""

from __future__ import annotations

import json
import time

import pytest

from kvpool_client import KVPoolClient
from kvpool_client.loadgen.main import main
from kvpool_client.loadgen.preflight import explain_incomplete, pool_fit


def test_wrong_target_fails_fast_and_says_so(capsys, tmp_path):
    started = time.monotonic()
    code = main(["--target", f"unix:{tmp_path}/none.sock", "--connect-timeout", "1", "--no-progress"])
    assert code == 2 and time.monotonic() - started < 10
    assert "no unix socket at" in capsys.readouterr().err


def test_a_pool_too_small_for_one_request_is_refused_before_starting(server_factory, capsys):
    server = server_factory("--num-blocks", "8")
    code = main(["--target", server.address, "--completions", "3", "--no-progress"])
    assert code == 2
    assert "the pool is too small for this load: one request may need 16 blocks" in capsys.readouterr().err


def test_pool_fit_counts_every_sequence_of_a_request():
    fit = pool_fit(num_blocks=100, block_size=16, max_len=64, sequences_per_request=4, concurrency=8)
    assert (fit.blocks_per_request, fit.blocks_in_flight, fit.one_fits, fit.all_fit) == (16, 128, True, False)


def test_incomplete_run_is_explained(server_factory, tmp_path, capsys):
    server = server_factory("--num-blocks", "8")
    with KVPoolClient(server.address) as other:  # another frontend holds 6 of the 8 blocks for the whole run
        hog = other.register()
        other.append([hog], 96)
        out = tmp_path / "s.json"
        code = main(["--target", server.address, "--completions", "6", "--max-len", "64", "--exhausted-wait", "1",
                     "--no-progress", "--json", str(out)])
        other.free([hog])
    text = capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert summary["run"]["completions"] < 6
    assert code == 1
    assert "requests completed:" in text and "the pool ran out of blocks" in text
    assert summary["diagnosis"] == explain_incomplete(summary)


def test_plot_marks_a_failed_run(tmp_path):
    pytest.importorskip("matplotlib")
    from kvpool_client.loadgen.plot import failure_reason, plot_memory

    stats = {"t": [0.0, 1.0], "used": [0, 4], "unused": [0, 3], "shared": [0, 0]}
    summary = {
        "ok": False, "config": {"mode": "beam", "concurrency": 2, "lengths": "uniform", "max_len": 64,
                                "block_size": 16, "token_bytes": 512, "completions": 5},
        "run": {"completions": 0}, "verification": {"errors": 0}, "worker_errors": ["RESOURCE_EXHAUSTED in X"],
        "end": {"blocks_total": 8, "invariants_ok": True},
        "memory": {"block_bytes": 8192, "naive_blocks_per_seq": 4, "paged_over_naive_peak": 0.5},
        "series": {"stats": stats, "sequences": {"t": [0.0, 1.0], "seqs": [0, 2]},
                   "unshared": {"t": [0.0, 1.0], "blocks": [0, 6]}},
    }
    assert failure_reason(summary) == "0 / 5 completed (pool out of blocks)"
    plot_memory(summary, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").stat().st_size > 10_000


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, capsys, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit) as exit_:
        main(["--target", f"unix:{tmp_path}/none.sock", "--plot", str(tmp_path / "p.png")])
    assert exit_.value.code == 2 and "--plot needs matplotlib" in capsys.readouterr().err
