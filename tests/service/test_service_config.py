"""ServerConfig: defaults, flags over KVPOOL_* environment over defaults, and validation messages."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from kvpool.layout import KVLayout
from kvpool_server.config import (
    DEFAULT_POOL_BYTES,
    ConfigError,
    ServerConfig,
    build_parser,
    load_config,
    parse_bytes,
)
from kvpool_server.host_checks import check_environment
from kvpool_server.settings import settings_of


def test_defaults_are_the_seed_layout_on_localhost() -> None:
    config = load_config([], environ={})
    assert config.address == "127.0.0.1:50051" and config.unix_socket is None
    assert config.layout == KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype="float32")
    assert config.layout.token_bytes == 512
    assert config.pool_size_kwargs() == {"pool_bytes": DEFAULT_POOL_BYTES} and DEFAULT_POOL_BYTES == 256 << 20
    assert config.backend == "auto" and config.log_level == "INFO"


def test_flags_override_environment_override_defaults() -> None:
    env = {
        "KVPOOL_POOL_BYTES": "64MiB", "KVPOOL_MAX_BATCH": "32", "KVPOOL_BACKEND": "host", "KVPOOL_LOG_LEVEL": "debug"
    }
    config = load_config(["--max-batch", "7", "--address", "127.0.0.1:0", "--unix-socket", "/tmp/x.sock"], environ=env)
    assert config.max_batch == 7  # flag beats env
    assert config.pool_size_kwargs() == {"pool_bytes": 64 << 20}  # env beats default
    assert (config.backend, config.log_level, config.address, config.unix_socket) == (
        "host", "DEBUG", "127.0.0.1:0", "/tmp/x.sock"
    )


@pytest.mark.parametrize(
    "text, value", [("4096", 4096), ("256MiB", 256 << 20), ("256m", 256 << 20), ("1GiB", 1 << 30), ("2k", 2048)]
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def test_sizing_choices() -> None:
    assert load_config(["--num-blocks", "10"], environ={}).pool_size_kwargs() == {"num_blocks": 10}
    assert load_config(["--gpu-memory-fraction", "0.5"], environ={}).pool_size_kwargs() == {"gpu_memory_fraction": 0.5}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"address": "", "unix_socket": None}, "nothing to listen on"),
        ({"address": "127.0.0.1:99999"}, "port must be 0..65535"),
        ({"address": "", "unix_socket": "/tmp/s", "port_file": "/tmp/p"}, "--port-file needs a TCP"),
        ({"pool_bytes": 1, "num_blocks": 1}, "give one of"),
        ({"pool_bytes": 0}, "--pool-bytes must be >= 1"),
        ({"gpu_memory_fraction": 1.5}, "(0, 1]"),
        ({"backend": "tpu"}, "--backend"),
        ({"dtype": "int8"}, "--dtype"),
        ({"head_dim": 0}, "--head-dim must be >= 1"),
        ({"max_batch": 0}, "--max-batch must be >= 1"),
        ({"max_seq_len": 0}, "--max-seq-len must be >= 1"),
        ({"max_message_bytes": 1000}, "--max-message-bytes"),
        ({"head_dim": 1 << 23}, "does not fit --max-message-bytes"),
        ({"shutdown_grace_s": -1}, "--shutdown-grace-s"),
        ({"log_level": "LOUD"}, "--log-level"),
        ({"cpu_affinity": "0-"}, "--cpu-affinity must be a CPU list"),
        ({"cpu_affinity": "3-1"}, "--cpu-affinity must be a CPU list"),
        ({"cpu_affinity": "x"}, "--cpu-affinity must be a CPU list"),
        ({"event_buffer_bytes": (1 << 20) - 1}, "--event-buffer-bytes must be >= 1048576, got 1048575"),
        ({"max_sessions": 0}, "--max-sessions must be >= 1, got 0"),
        ({"max_inflight_bytes": 2 << 20, "max_message_bytes": 1 << 20},
         "--max-inflight-bytes must be >= 4194304 and >= --max-message-bytes=1048576, got 2097152"),
        ({"max_inflight_bytes": 32 << 20}, "--max-inflight-bytes must be >= 4194304 and >= "
         "--max-message-bytes=67108864, got 33554432"),
        ({"session_ttl_ms": 99}, "--session-ttl-ms must be in [100, --max-session-ttl-ms=300000], got 99"),
        ({"gpu_memory_fraction": 0.0}, "--gpu-memory-fraction must be in (0, 1], got 0.0"),
        ({"kv_layout": "diagonal"}, "--kv-layout must be one of block-major, layer-major, got 'diagonal'"),
    ],
)
def test_validation_names_the_setting(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        ServerConfig(**changes).validate()


def test_validate_reads_no_host_state_and_changes_nothing(tmp_path) -> None:
    """validate() and load_config() are pure; what the settings name on this host (files, CPUs) is
    check_environment's to check (main runs it right after loading)."""
    missing = str(tmp_path / "missing.toml")
    config = ServerConfig(auth_tokens=missing, cpu_affinity="100000", log_level="debug")
    before = dataclasses.replace(config)
    assert config.validate() is config and config == before  # log_level stays as given: no mutation
    with pytest.raises(ConfigError, match=f"--auth-tokens {missing}: no such file"):
        check_environment(load_config(["--auth-tokens", missing], environ={}))
    with pytest.raises(ConfigError, match="--cpu-affinity names CPUs \\[100000\\] this process may not use"):
        check_environment(load_config(["--cpu-affinity", "100000"], environ={}))
    with pytest.raises(ConfigError, match="may not use"):
        check_environment(ServerConfig(cpu_affinity="100000"))


def test_every_setting_is_one_declaration_with_flag_env_and_help() -> None:
    """Each field of ServerConfig is declared with setting(): its flag and help are in --help, its KVPOOL_ variable
    is read, and nothing else is (no field without a setting)."""
    declared = settings_of(ServerConfig)
    assert [s.name for s in declared] == [f.name for f in dataclasses.fields(ServerConfig)]
    help_text = " ".join(build_parser().format_help().split())
    for s in declared:
        assert s.flag in help_text, s.flag
        assert " ".join(s.spec.help.split()) in help_text, s.name
        assert s.env == "KVPOOL_" + s.name.upper() and s.flag == "--" + s.name.replace("_", "-")
    # Every declared variable is read: give each its default (as text) and nothing changes.
    environ = {s.env: _as_text(s.default) for s in declared if s.default is not None}
    assert load_config([], environ=environ) == load_config([], environ={})


def _as_text(value: object) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("name, flag_value, env_value, expected_flag, expected_env", [
    ("event_buffer_bytes", "2MiB", "3MiB", 2 << 20, 3 << 20),
    ("max_inflight_bytes", "128MiB", "512MiB", 128 << 20, 512 << 20),
    ("max_sessions", "7", "9", 7, 9),
    ("stream_idle_timeout_s", "1.5", "2.5", 1.5, 2.5),
    ("kv_layout", "layer-major", "layer-major", "layer-major", "layer-major"),
])
def test_new_and_old_settings_take_flag_over_env_over_default(name, flag_value, env_value, expected_flag,
                                                              expected_env) -> None:
    flag, env = "--" + name.replace("_", "-"), "KVPOOL_" + name.upper()
    assert getattr(load_config([flag, flag_value], environ={env: env_value}), name) == expected_flag
    assert getattr(load_config([], environ={env: env_value}), name) == expected_env
    assert getattr(load_config([], environ={}), name) == getattr(ServerConfig(), name)


def test_new_settings_defaults() -> None:
    config = ServerConfig()
    assert (config.event_buffer_bytes, config.max_sessions, config.max_inflight_bytes) == (64 << 20, 4096, 256 << 20)


def test_layout_settings_are_kvlayouts_own_fields() -> None:
    """The layout flags are KVLayout's fields with KVLayout's defaults, and config.layout is built from them."""
    for field in dataclasses.fields(KVLayout):
        assert ServerConfig.__dataclass_fields__[field.name].default == field.default, field.name
    config = load_config(["--num-layers", "2", "--head-dim", "8", "--dtype", "bfloat16", "--kv-layout",
                          "layer-major"], environ={})
    assert config.layout == KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype="bfloat16",
                                     kv_layout="layer-major")


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KVPOOL_NUM_LAYERS"):
        load_config([], environ={"KVPOOL_NUM_LAYERS": "two"})


def test_cpu_affinity_lists() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert ServerConfig().cpu_set() is None
    assert ServerConfig(cpu_affinity=str(allowed[0])).cpu_set() == {allowed[0]}
    if allowed[:2] == [0, 1]:
        assert ServerConfig(cpu_affinity="0-1").cpu_set() == {0, 1}
        assert ServerConfig(cpu_affinity=" 1, 0 ").cpu_set() == {0, 1}
    assert load_config(["--cpu-affinity", str(allowed[-1])], environ={}).cpu_affinity == str(allowed[-1])
    assert load_config([], environ={"KVPOOL_CPU_AFFINITY": str(allowed[0])}).cpu_set() == {allowed[0]}
