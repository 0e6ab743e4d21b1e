"""What kvpool-server says at start (issue 24.7): a misspelt KVPOOL_* variable is warned about, not silently
ignored; with --log-format json (or KVPOOL_LOG_FORMAT=json) even a fatal start-up error is a JSON line."""

from __future__ import annotations

import json
import os
import subprocess

from kvpool_server.config import OTHER_TOOLS_VARIABLES, ServerConfig
from kvpool_server.log_setup import requested_log_format
from kvpool_server.settings import unknown_variables
from tests.conftest import server_command


def test_unknown_variables_are_named_with_the_setting_they_resemble():
    environ = {"KVPOOL_POOL_BYTE": "1", "KVPOOL_POOL_BYTES": "8MiB", "KVPOOL_TARGET": "x", "KVPOOL_TOKEN_FILE": "f",
               "KVPOOL_CLIENT_TLS_CA": "ca.pem", "KVPOOL_LOADGEN_SEED": "1", "KVPOOL_ZZZ": "1", "PATH": "/bin"}
    warnings = unknown_variables(ServerConfig, environ, OTHER_TOOLS_VARIABLES)
    assert warnings == ["KVPOOL_POOL_BYTE is not a kvpool-server setting: ignored (did you mean KVPOOL_POOL_BYTES?)",
                        "KVPOOL_ZZZ is not a kvpool-server setting: ignored"]


def test_requested_log_format():
    assert requested_log_format(["--log-format", "json"], {}) == "json"
    assert requested_log_format(["--log-format=json"], {}) == "json"
    assert requested_log_format([], {"KVPOOL_LOG_FORMAT": "JSON"}) == "json"
    assert requested_log_format(["--log-format", "text"], {"KVPOOL_LOG_FORMAT": "json"}) == "text"
    assert requested_log_format([], {}) == "text"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")} | (env or {})
    return subprocess.run(server_command() + list(args), capture_output=True, text=True, timeout=60, env=environ)


def test_fatal_errors_in_json(tmp_path):
    result = _run("--log-format", "json", "--max-sessions", "0")
    entry = json.loads(result.stderr.strip().splitlines()[-1])
    assert result.returncode == 2 and entry["level"] == "CRITICAL" and "--max-sessions" in entry["msg"]
    result = _run("--backend", "host", "--pool-bytes", "8MiB", "--address", "",
                  "--unix-socket", str(tmp_path / "missing" / "s.sock"), env={"KVPOOL_LOG_FORMAT": "json"})
    entry = json.loads(result.stderr.strip().splitlines()[-1])
    assert result.returncode == 1 and entry["level"] == "CRITICAL" and "does not exist" in entry["msg"]
    result = _run("--max-sessions", "0")
    assert result.returncode == 2 and result.stderr.startswith("kvpool-server: --max-sessions")
