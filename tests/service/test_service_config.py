"""ServerConfig: defaults, flags over KVPOOL_* environment over defaults, and validation messages."""

from __future__ import annotations

import os

import pytest

from kvpool.layout import KVLayout
from kvpool_server.config import DEFAULT_POOL_BYTES, ConfigError, ServerConfig, load_config, parse_bytes


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
        ({"cpu_affinity": "100000"}, "may not use"),
    ],
)
def test_validation_names_the_setting(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
        ServerConfig(**changes).validate()


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
