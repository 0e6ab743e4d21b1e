"""docs/ops.md's secured deployment runs verbatim under sh: certificates, tokens, a server with --auth-tokens and
mutual TLS, kvctl and the load generator against it, SIGHUP, SIGTERM (issue 24: "commands that run verbatim")."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[2] / "docs" / "ops.md"
PORT = 50443  # the walk-through's


def _blocks() -> str:
    text = OPS.read_text()
    section = text[text.index("## A secured deployment, end to end"):]
    section = section[:section.index("\n## ", 10)]
    return "".join(re.findall(r"```sh\n(.*?)```", section, re.S))


def _port_free() -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", PORT)) != 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_the_secured_deployment_runs_verbatim(tmp_path):
    if not _port_free():
        pytest.skip(f"port {PORT} is in use")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)  # the checkout's .venv
    script = tmp_path / "walk.sh"
    script.write_text("set -e\n" + _blocks())
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    out = subprocess.run(["sh", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    log = out.stdout + out.stderr
    try:
        assert out.returncode == 0, log
        assert "auth on: 2 tokens (1 admin), 2 tenants; TLS on, mutual (client CA ca.pem)" in log
        assert "server: SERVING" in log and "0 sessions" in log
        assert "exit 1: an admin's command" in log and "PERMISSION_DENIED" in log
        assert "result: PASS" in log
        assert "SIGHUP: reloaded tokens.toml" in log and "stopped" in log
        token = (tmp_path / "secure" / "frontend-token").read_text().strip()
        assert token not in log
    finally:
        pid_file = tmp_path / "secure" / "server.pid"  # a run that failed half-way leaves its server
        cmdline = Path(f"/proc/{pid_file.read_text().strip()}/cmdline") if pid_file.exists() else None
        if cmdline is not None and cmdline.exists() and b"kvpool-server" in cmdline.read_bytes():
            os.kill(int(pid_file.read_text()), 9)
