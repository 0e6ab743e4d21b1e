"""Interrupting kvpool-loadgen (issue 24.5): SIGINT to its main process, or to its whole process group (a terminal's
Ctrl-C), stops the run -- workers included -- prints what was done, writes the JSON and exits 130; no traceback,
and no worker left loading the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool_client import KVPoolClient
from tests.loadgen.test_loadgen_e2e import POOL

WAIT_S = 60.0  # a bound on waiting for the run to get going (not a timing assertion)


def _children(pid: int) -> list[int]:
    """The worker processes of ``pid`` (spawned: multiprocessing's spawn_main, not its resource tracker)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            kids.append(int(entry.name))
    return kids


@pytest.mark.parametrize("to", ["main process", "process group"])
def test_sigint_stops_the_run_and_reports_what_was_done(server_factory, tmp_path, to):
    server = server_factory(*POOL)
    json_path = tmp_path / "summary.json"
    script = Path(sys.executable).with_name("kvpool-loadgen")
    proc = subprocess.Popen(
        [str(script), "--target", server.address, "-n", "100000", "-p", "2", "-c", "8", "--no-progress",
         "--json", str(json_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        with KVPoolClient(server.address, session=False) as client:
            deadline = time.monotonic() + WAIT_S
            while client.stats().num_sequences == 0:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
                time.sleep(0.05)
        workers = _children(proc.pid)
        assert len(workers) == 2
        if to == "main process":
            os.kill(proc.pid, signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert "result: FAIL (interrupted by SIGINT)" in output and "requests completed and verified" in output
    summary = json.loads(json_path.read_text())
    assert summary["interrupted"] == "SIGINT" and not summary["ok"]
    assert summary["run"]["completions"] < 100000 and summary["verification"]["errors"] == 0
    assert summary["run"]["tokens_appended"] > 0 and summary["run"]["stopped_in_flight"] > 0  # what it did
    assert summary["worker_errors"] == []
    # the workers are gone and their sessions closed: nothing of the run is left on the server
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    with KVPoolClient(server.address, session=False) as client:
        stats = client.stats()
        assert (stats.num_sequences, stats.num_blocks_used) == (0, 0)
        assert client.check_invariants().ok
