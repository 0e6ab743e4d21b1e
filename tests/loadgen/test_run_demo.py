"""`make run`'s script end to end: its own server, the load generator, a clean SIGTERM shutdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_run_demo_starts_runs_and_stops_cleanly(tmp_path):
    env = dict(os.environ, KVPOOL_DEMO_OUT=str(tmp_path), KVPOOL_BACKEND="host")
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_demo.py"), "--completions", "12", "--no-progress"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SERVING" in out.stdout and "result: PASS" in out.stdout
    assert "server stopped cleanly (SIGTERM, exit 0)" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["completions"] == 12 and summary["verification"]["errors"] == 0
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
