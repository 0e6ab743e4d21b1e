"""The wire contract: buf STANDARD lint clean, and the committed generated code matches the proto."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO = "kvpool/v1/kvpool.proto"
GENERATED = ("kvpool_pb2.py", "kvpool_pb2.pyi", "kvpool_pb2_grpc.py")


def test_buf_lint_standard_is_clean():
    buf = shutil.which("buf", path=str(Path(sys.executable).parent))
    if buf is None:
        pytest.fail("buf (PyPI buf-bin, requirements/dev.txt) is not installed beside this interpreter")
    result = subprocess.run([buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_is_up_to_date(tmp_path):
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"), f"--python_out={tmp_path}",
           f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(ROOT / "protos" / PROTO)]
    subprocess.run(cmd, check=True)
    for name in GENERATED:
        fresh = (tmp_path / "kvpool" / "v1" / name).read_text()
        committed = (ROOT / "common" / "kvpool" / "v1" / name).read_text()
        assert fresh == committed, f"common/kvpool/v1/{name} is stale: run `make proto`"


def test_package_path_matches_proto_package():
    from kvpool.v1 import kvpool_pb2

    assert kvpool_pb2.DESCRIPTOR.package == "kvpool.v1"
    assert kvpool_pb2.DESCRIPTOR.name == PROTO
    assert "KVPoolService" in kvpool_pb2.DESCRIPTOR.services_by_name
