"""scripts/image_smoke.sh and scripts/image_base.sh read as text (no Docker engine here; `make image-smoke` runs them
for real, outside `make test`), and scripts/image_smoke.sh's verdict on load generator summaries."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.docker.parsing import DOCKERFILE, REPO, Dockerfile

SMOKE = REPO / "scripts" / "image_smoke.sh"
BASE = REPO / "scripts" / "image_base.sh"
sys.path.insert(0, str(REPO / "scripts"))
import image_smoke_check  # noqa: E402


def _docker_commands(script, verb: str) -> list[list[str]]:
    """Each `docker VERB ...` command of the script, continuation lines joined, up to a redirection or `||`."""
    text = script.read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        match = re.search(rf"\bdocker {verb}\b(.*)", line)
        if match and not line.lstrip().startswith("#"):
            words = shlex.split(match[1].split(" > ")[0].split(" || ")[0])
            commands.append(words)
    return commands


def _option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


@pytest.mark.parametrize("script", [SMOKE, BASE], ids=lambda p: p.name)
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_every_container_on_the_host_network():
    """No container and no build step may reach the Docker bridge's addresses: host network (or none) throughout."""
    runs = _docker_commands(SMOKE, "run")
    builds = _docker_commands(SMOKE, "build")
    assert len(runs) == 2 and len(builds) == 1  # the server, the load generators (one function); one build loop
    for words in runs + builds:
        assert _option(words, "--network") in ("host", "none"), words
    assert "--network none" in BASE.read_text()  # the base's own check runs with no network at all


def test_server_container_shares_its_ipc_namespace_and_listens_on_loopback_only():
    server = next(w for w in _docker_commands(SMOKE, "run") if "kvpool-server:$tag" in w)
    assert _option(server, "--ipc") == "shareable" and "--init" in server
    env = dict(w.split("=", 1) for w in server[1::] if "=" in w and w.startswith("KVPOOL_"))
    assert set(env) == {"KVPOOL_ADDRESS", "KVPOOL_UNIX_SOCKET", "KVPOOL_BACKEND", "KVPOOL_POOL_BYTES"}
    text = SMOKE.read_text()
    assert 'address=""' in text and "address=127.0.0.1:$port" in text  # no TCP, or TCP on loopback only
    assert "0.0.0.0" not in text


def test_server_settings_are_valid_for_kvpool_server():
    """The server's environment, as the script gives it, loads with kvpool-server's own configuration loader."""
    server_config = pytest.importorskip("kvpool_server.config")
    env = {**Dockerfile().env("server"),  # the image's ENV, then the script's -e (which win)
           "KVPOOL_ADDRESS": "", "KVPOOL_UNIX_SOCKET": "/run/kvpool/kvpool.sock", "KVPOOL_BACKEND": "host",
           "KVPOOL_POOL_BYTES": "64MiB"}
    loaded = server_config.load_config([], environ=env)
    loaded.validate()
    assert (loaded.address, loaded.unix_socket, loaded.backend) == ("", "/run/kvpool/kvpool.sock", "host")


def test_load_generators_join_the_server_and_their_flags_parse():
    loadgen_main = pytest.importorskip("kvpool_client.loadgen.main")
    loadgen = next(w for w in _docker_commands(SMOKE, "run") if "$image" in w)
    assert _option(loadgen, "--ipc") == "container:$server" and _option(loadgen, "--pid") == "container:$server"
    flags = loadgen[loadgen.index("$image") + 1:]
    flags = [{"$target": "unix:/run/kvpool/kvpool.sock", "$completions": "100"}.get(f, f) for f in flags]
    parser = loadgen_main.build_parser()
    args = parser.parse_args(flags)
    loadgen_main.check_args(parser, args)
    assert (args.kv_path, args.verify, args.json) == ("attach", "both", "/results/summary.json")
    assert 'loadgen "kvpool-loadgen:$tag"' in SMOKE.read_text() and 'loadgen "kvpool-client:$tag"' in SMOKE.read_text()


def test_builds_the_dockerfiles_targets_through_its_base_arguments():
    text = SMOKE.read_text()
    targets = re.search(r"for target in ([\w ]+); do", text)[1].split()
    dockerfile = Dockerfile()
    images = [name for name, stage in dockerfile.stages.items() if any(kw == "ENTRYPOINT" for kw, _ in stage.instructions)]
    assert sorted(targets) == sorted(images)  # every image the Dockerfile makes (not the shared runtime stage)
    global_args = re.findall(r"^ARG (\w+)=", DOCKERFILE.read_text(), flags=re.MULTILINE)
    for arg in re.findall(r'--build-arg "(\w+)=\$base"', text):
        assert arg in global_args
    assert len(re.findall(r'--build-arg "(\w+)=\$base"', text)) == 2


def test_sigterm_and_a_clean_exit_are_required():
    text = SMOKE.read_text()
    assert 'docker kill -s TERM "$server"' in text
    assert '[ "$code" = 0 ] || fail' in text
    assert "trap cleanup EXIT" in text and 'docker volume rm -f "$volume"' in text


def test_make_targets_outside_make_test():
    makefile = (REPO / "Makefile").read_text()
    assert "bash scripts/image_smoke.sh $(BASE)" in makefile and "bash scripts/image_base.sh $(IMAGE_BASE)" in makefile
    test_recipe = re.search(r"^test:.*?\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)[1]
    assert "image" not in test_recipe and "docker" not in test_recipe


# --- scripts/image_smoke_check.py: the load generator's --json summary, trimmed to what the check reads ----------------
PASSING = {
    "config": {"completions": 100, "kv_path": "attach"},
    "run": {"completions": 100, "fast_path_appends": 3373},
    "verification": {"method": "page table + attached pool, and ReadKV", "tokens_verified": 14573, "errors": 0,
                     "checks_failed": 0},
    "end": {"blocks_used": 0, "sequences": 0, "invariants_ok": True, "invariants_error": "", "invariants_checked": True},
    "worker_errors": [],
    "kv_path": {"path": "attach", "why": [], "grpc_processes": 0},
    "interrupted": None,
    "ok": True,
}


def _broken(path: str, value):
    summary = copy.deepcopy(PASSING)
    *parents, key = path.split(".")
    node = summary
    for parent in parents:
        node = node[parent]
    node[key] = value
    return summary


def test_a_passing_summary_passes():
    assert image_smoke_check.problems(PASSING, kv_path="attach", fast_path=True) == []


@pytest.mark.parametrize(("path", "value", "expected"), [
    ("ok", False, "ok is False"),
    ("interrupted", "SIGTERM", "interrupted"),
    ("run.completions", 99, "99 of 100"),
    ("verification.errors", 3, "KV verification errors: 3"),
    ("verification.checks_failed", 1, "checks failed"),
    ("verification.tokens_verified", 0, "no token"),
    ("worker_errors", ["Traceback ..."], "worker errors"),
    ("end.invariants_ok", False, "invariants"),
    ("end.invariants_checked", False, "invariants"),
    ("end.blocks_used", 4, "left in the pool"),
    ("kv_path.path", "grpc", "KV path"),
    ("run.fast_path_appends", 0, "fast path"),
])
def test_each_failure_is_named(path, value, expected):
    found = image_smoke_check.problems(_broken(path, value), kv_path="attach", fast_path=True)
    assert len(found) == 1 and expected in found[0], found


def test_grpc_path_and_no_fast_path_pass_when_not_required():
    summary = _broken("kv_path.path", "grpc")
    summary["run"]["fast_path_appends"] = 0
    assert image_smoke_check.problems(summary) == []


def test_the_check_as_a_program(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(PASSING))
    bad.write_text(json.dumps(_broken("verification.errors", 2)))
    script = str(REPO / "scripts" / "image_smoke_check.py")
    ok = subprocess.run([sys.executable, script, str(good), "--kv-path", "attach", "--fast-path"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("image_smoke_check: PASS: 100 completions, 14573 tokens")
    failed = subprocess.run([sys.executable, script, str(bad)], capture_output=True, text=True)
    assert failed.returncode == 1 and "KV verification errors: 2" in failed.stdout
    missing = subprocess.run([sys.executable, script, str(tmp_path / "none.json")], capture_output=True, text=True)
    assert missing.returncode == 1 and "cannot read" in missing.stdout
