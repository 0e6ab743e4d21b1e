"""kvpool-server --config kvpool.toml (issue 35 item 2): the settings' own names in TOML; flags > KVPOOL_* > the
file > defaults; unknown keys and wrong types refused, naming the nearest setting; --print-config shows the merged
settings with their sources, as a file the server reads back; a real server started from a file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool_client import KVPoolClient
from kvpool_server.config import ConfigError, load_config, load_config_and_sources
from kvpool_server.config_file import MAX_FILE_BYTES
from tests.conftest import server_command


def write(tmp_path, text: str):
    path = tmp_path / "kvpool.toml"
    path.write_text(text)
    return str(path)


def test_flags_beat_variables_beat_the_file_beats_the_defaults(tmp_path):
    path = write(tmp_path, 'pool_bytes = "64MiB"\nmax_workers = 3\nlog_level = "debug"\nbackend = "host"\n')
    config, sources = load_config_and_sources(["--config", path, "--max-workers", "5"],
                                              environ={"KVPOOL_LOG_LEVEL": "WARNING", "KVPOOL_BACKEND": "gpu"})
    assert config.pool_bytes == 64 << 20 and sources["pool_bytes"] == f"file {path}"
    assert config.max_workers == 5 and sources["max_workers"] == "flag --max-workers"
    assert config.log_level == "WARNING" and sources["log_level"] == "env KVPOOL_LOG_LEVEL"
    assert config.backend == "gpu" and sources["backend"] == "env KVPOOL_BACKEND"
    assert "max_streams" not in sources and config.max_streams == 1024  # the default
    assert load_config([], environ={"KVPOOL_CONFIG": path}).pool_bytes == 64 << 20  # the file from the environment


def test_a_value_in_the_file_is_checked_as_a_flag_is(tmp_path):
    with pytest.raises(ConfigError, match="--max-workers must be >= 1, got 0"):
        load_config(["--config", write(tmp_path, "max_workers = 0\n")], environ={})


@pytest.mark.parametrize("text, says", [
    ("pool_byte = 1\n", "'pool_byte' is not a kvpool-server setting (did you mean pool_bytes?)"),
    ("pool-bytes = 1\n", "'pool-bytes' is not a kvpool-server setting (did you mean pool_bytes?)"),
    ("max_workers = \"8\"\n", "max_workers = \"8\" must be an integer"),
    ("insecure = 1\n", "insecure = 1 must be true or false"),
    ("pool_bytes = \"lots\"\n", "is not a size"),
    ("[server]\naddress = \"x\"\n", "'server' is not a kvpool-server setting"),
    ("pool_bytes = \n", "not TOML"),
], ids=["misspelt", "dashes", "int-as-text", "bool-as-int", "size", "table", "syntax"])
def test_bad_files_are_refused_naming_the_key(tmp_path, text, says):
    with pytest.raises(ConfigError) as caught:
        load_config(["--config", write(tmp_path, text)], environ={})
    assert says in str(caught.value) and "kvpool.toml" in str(caught.value)


def test_a_missing_or_oversized_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        load_config(["--config", str(tmp_path / "none.toml")], environ={})
    with pytest.raises(ConfigError, match="not a kvpool config file"):
        load_config(["--config", write(tmp_path, "#" * (MAX_FILE_BYTES + 1))], environ={})


def test_sizes_take_bytes_or_text_and_floats_take_integers(tmp_path):
    config = load_config(["--config", write(tmp_path, 'pool_bytes = 1048576\nhost_tier_bytes = "1MiB"\n'
                                                      'shutdown_grace_s = 30\n')], environ={})
    assert config.pool_bytes == config.host_tier_bytes == 1 << 20 and config.shutdown_grace_s == 30.0


def _server(*argv: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin"}
    return subprocess.run(server_command() + list(argv), capture_output=True, text=True, timeout=60, env=env)


def test_print_config_shows_each_source_and_reads_back(tmp_path):
    path = write(tmp_path, 'pool_bytes = "64MiB"\nbackend = "host"\n')
    out = _server("--config", path, "--max-workers", "3", "--print-config")
    assert out.returncode == 0, out.stderr
    lines = {line.split(" = ")[0]: line for line in out.stdout.splitlines() if " = " in line}
    assert lines["pool_bytes"].startswith('pool_bytes = "64MiB"') and lines["pool_bytes"].endswith(f"# file {path}")
    assert lines["max_workers"].startswith("max_workers = 3") and lines["max_workers"].endswith("# flag --max-workers")
    assert lines["max_streams"].endswith("# default")
    again = _server("--config", write(tmp_path, out.stdout), "--print-config")  # the output is a config file
    assert again.returncode == 0, again.stderr
    assert [line.split("#")[0] for line in again.stdout.splitlines()[1:]] == \
        [line.split("#")[0] for line in out.stdout.splitlines()[1:]]


def test_a_bad_file_stops_the_server_with_exit_2(tmp_path):
    out = _server("--config", write(tmp_path, "pool_byte = 1\n"))
    assert out.returncode == 2 and "did you mean pool_bytes?" in out.stderr


def test_a_server_started_from_a_file(server_factory, tmp_path):
    server = server_factory("--config", write(tmp_path, "block_size = 32\nmax_workers = 2\n"))
    with KVPoolClient(server.address, session=False) as kv:
        assert kv.describe_pool().layout.block_size == 32


def test_help_names_the_file(capsys):
    from kvpool_server.config import build_parser

    assert "--config FILE" in build_parser().format_help() and "--print-config" in build_parser().format_help()
    assert sys.executable  # the help is the server's own
