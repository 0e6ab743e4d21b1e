"""The project as a user gets it (issue 35 item 1): pip's `build` makes the sdist and, from it, the wheel; the wheel
goes into a fresh virtual environment with pip, and what is installed there runs: kvpool-server serves, kvctl and
the client library talk to it, kvpool-token --help answers. A module, a data file (the stubs' .pyi, py.typed) or a
console script left out of the packaging fails here.

The fresh environment takes its third-party dependencies from the test's own environment through a .pth line (a
directory listed in a .pth is searched but its own .pth files are not run, so the checkout's editable install stays
out): no download, and every kvpool module comes from the wheel -- the test checks that it does."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    env = tmp_path_factory.mktemp("venv") / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    (wheel,) = dist.glob("kvpool-*.whl")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install",
                              "-q", "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    purelib = subprocess.run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "deps-from-the-test-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return env


def _run(venv: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_", "PYTHON"))}
    return subprocess.run(argv, cwd=venv, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_sdist_carries_what_the_wheel_is_built_from(dist):
    (sdist,) = dist.glob("kvpool-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    for needed in ("pyproject.toml", "README.md", "LICENSE", "common/kvpool/v1/kvpool_pb2.pyi",
                   "client/kvpool_client/__init__.py", "server/kvpool_server/main.py"):
        assert needed in names, needed


def test_the_wheel_holds_every_package_and_its_data(dist):
    (wheel,) = dist.glob("kvpool-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source_root in ("common", "client", "server"):
        for module in (ROOT / source_root).rglob("*.py"):
            if "__pycache__" not in module.parts and "egg-info" not in str(module):
                assert module.relative_to(ROOT / source_root).as_posix() in names, module
    for data in ("kvpool/py.typed", "kvpool/v1/kvpool_pb2.pyi", "kvpool_client/py.typed", "kvpool_server/py.typed"):
        assert data in names, data
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for extra in ("server", "gpu", "gpu-cuda13", "vllm", "loadgen"):
        assert f"Provides-Extra: {extra}" in metadata, extra
    assert "Requires-Dist: grpcio-reflection" in metadata and 'extra == "server"' in metadata


def test_the_installed_wheel_runs(venv, tmp_path):
    python = str(venv / "bin" / "python")
    where = _run(venv, python, "-c", "import kvpool, kvpool_client, kvpool_server; "
                                     "print(kvpool.__file__, kvpool_client.__file__, kvpool_server.__file__)")
    assert where.returncode == 0, where.stderr
    assert all(path.startswith(str(venv)) for path in where.stdout.split()), where.stdout  # not the checkout's
    for script in ("kvpool-server", "kvctl"):  # the version comes from the installed distribution's metadata
        assert _run(venv, str(venv / "bin" / script), "--version").stdout.split() == [script, "0.1.0"]
    assert _run(venv, str(venv / "bin" / "kvpool-token"), "--help").returncode == 0
    socket_path = tmp_path / "kvpool.sock"
    server = subprocess.Popen([str(venv / "bin" / "kvpool-server"), "--unix-socket", str(socket_path), "--address", "",
                               "--backend", "host", "--pool-bytes", "2MiB"], cwd=venv,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(120):  # until it serves (the pool allocation first) or exits
            health = _run(venv, str(venv / "bin" / "kvctl"), "--unix-socket", str(socket_path), "health")
            if health.returncode == 0 or server.poll() is not None:
                break
            time.sleep(0.25)
        assert health.returncode == 0 and "SERVING" in health.stdout, health.stdout + health.stderr
        client = _run(venv, python, "-c", f"""
from kvpool_client import KVPoolClient
with KVPoolClient("unix:{socket_path}") as kv:
    seq = kv.register()
    print(kv.append([seq], num_tokens=[20]).slot_mapping.size)
""")
        assert client.returncode == 0 and client.stdout.strip() == "20", client.stderr
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=30)
    assert server.returncode == 0, out
