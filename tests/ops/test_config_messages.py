"""The messages a new user meets first: sizes, environment values, a GPU that is not there, --version, JSON logs."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_server.config import (
    ConfigError,
    JsonLogFormatter,
    ServerConfig,
    load_config,
    parse_bytes,
    server_version,
)
from kvpool_server.host_checks import pool_error_message
from tests.conftest import server_command

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("text, value", [("256MB", 256 << 20), ("256MiB", 256 << 20), ("1GiB", 1 << 30),
                                         ("1.5 GiB", 3 << 29), ("512kb", 512 << 10), ("4096B", 4096),
                                         ("1_048_576", 1 << 20)])
def test_sizes_in_the_forms_people_type(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["abc", "256 potatoes", "MiB", "nanGiB", ""])
def test_a_bad_size_lists_the_accepted_forms(text):
    with pytest.raises(ConfigError, match="is not a size: give bytes .*256MiB"):
        parse_bytes(text)


def test_flag_error_is_not_argparses_default(capsys):
    with pytest.raises(SystemExit):
        load_config(["--pool-bytes", "256 potatoes"], environ={})
    err = capsys.readouterr().err
    assert "argument --pool-bytes: '256 potatoes' is not a size" in err and "invalid parse_bytes" not in err


@pytest.mark.parametrize("env, words", [
    ({"KVPOOL_POOL_BYTES": "abc"}, "KVPOOL_POOL_BYTES='abc' (as --pool-bytes) is not a size: give bytes"),
    ({"KVPOOL_MAX_BATCH": "lots"}, "KVPOOL_MAX_BATCH='lots' (as --max-batch) must be an integer"),
    ({"KVPOOL_GPU_MEMORY_FRACTION": "half"}, "must be a number such as 0.5"),
])
def test_bad_environment_values_name_variable_flag_and_form(env, words):
    with pytest.raises(ConfigError) as info:
        load_config([], environ=env)
    assert words in str(info.value) and "invalid literal" not in str(info.value)


def test_no_gpu_message_says_what_to_do():
    error = RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")
    message = pool_error_message("gpu", error)
    assert "no CUDA GPU/driver found" in message and "--backend host or auto" in message
    assert "cudaErrorInsufficientDriver" in message
    assert "no CUDA GPU" in pool_error_message("gpu", ModuleNotFoundError("No module named 'cupy'"))
    assert pool_error_message("host", ValueError("x")) == "cannot create the host pool: x"


def test_no_gpu_message_from_the_real_pool_factory():
    """On this machine: whatever create_pool(backend="gpu") raises gets the advice (skipped where a GPU works)."""
    from kvpool.layout import KVLayout
    from kvpool_server.device import create_pool

    try:
        pool = create_pool(KVLayout(1, 1, 64, 16, "float32"), backend="gpu", pool_bytes=1 << 20)
    except Exception as exc:  # noqa: BLE001 -- any failure is what the message is for
        assert "--backend host or auto" in pool_error_message("gpu", exc)
    else:
        pool.close()
        pytest.skip("a GPU pool could be made here")


@pytest.mark.parametrize("changes, words", [({"metrics_address": "9400"}, "--metrics-address must be HOST:PORT"),
                                            ({"log_format": "xml"}, "--log-format must be one of text, json")])
def test_new_settings_validate(changes, words):
    with pytest.raises(ConfigError, match=words):
        ServerConfig(**changes).validate()
    assert ServerConfig(metrics_address="127.0.0.1:9400").validate().metrics_host_port() == ("127.0.0.1", 9400)


def test_json_log_lines():
    record = logging.LogRecord("kvpool_server", logging.INFO, __file__, 1, "listening on %s", ("x",), None)
    entry = json.loads(JsonLogFormatter().format(record))
    assert entry["msg"] == "listening on x" and entry["level"] == "INFO" and entry["ts"].endswith("Z")


@pytest.mark.parametrize("module, prog", [("kvpool_server", "kvpool-server"),
                                          ("kvpool_client.loadgen.main", "kvpool-loadgen"),
                                          ("kvpool_client.kvctl", "kvctl")])
def test_every_tool_has_version(module, prog):
    result = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{prog} {server_version()}"


@pytest.mark.parametrize("address", ["0.0.0.0:9400", ":9400", "[::]:9400", "10.1.2.3:9400", "metrics.example:9400"])
def test_metrics_on_a_network_address_need_insecure(address):
    """Metrics carry tenant names and usage and have no authentication: the rule of --address applies."""
    with pytest.raises(ConfigError, match=f"--metrics-address {re.escape(address)} is reachable from other hosts.*"
                                          "--insecure"):
        ServerConfig(metrics_address=address).validate()
    with pytest.raises(ConfigError, match="--metrics-address"):
        load_config([], environ={"KVPOOL_METRICS_ADDRESS": address})
    # --auth-tokens does not cover metrics (they are not authenticated); --insecure does.
    assert ServerConfig(metrics_address=address, insecure=True).validate().metrics_address == address
    assert load_config(["--metrics-address", address, "--insecure"], environ={}).insecure


@pytest.mark.parametrize("address", ["127.0.0.1:9400", "localhost:9400", "[::1]:0"])
def test_metrics_on_loopback_need_nothing(address):
    assert load_config(["--metrics-address", address], environ={}).metrics_address == address


def test_the_server_refuses_exposed_metrics_at_start():
    result = subprocess.run(server_command() + ["--backend", "host", "--pool-bytes", "1MiB", "--address",
                                                "127.0.0.1:0", "--metrics-address", "0.0.0.0:0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "kvpool-server: --metrics-address 0.0.0.0:0 is reachable from other hosts" in result.stderr
    assert "--insecure" in result.stderr


def test_the_docs_say_metrics_need_insecure():
    for page in ("metrics.md", "security.md"):
        text = " ".join((DOCS / page).read_text().split())
        assert "--metrics-address" in text and "--insecure" in text, page
        rule = r"non-loopback (`--metrics-address`|metrics address)[^;]* refused at start unless `--insecure`"
        assert re.search(rule, text), page
