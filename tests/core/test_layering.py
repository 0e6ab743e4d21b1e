"""The core imports neither grpc nor cupy; the device layer imports no grpc."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("kvpool_server.core", ("grpc", "cupy", "google.protobuf")),
        ("kvpool_server.device", ("grpc", "google.protobuf")),
        ("kvpool_client.layout", ("grpc", "cupy", "google.protobuf")),
    ],
)
def test_module_does_not_import(module, forbidden):
    code = (
        f"import sys, {module}\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {[f.split('.')[0] for f in forbidden]!r}"
        f" and any(m == f or m.startswith(f + '.') for f in {list(forbidden)!r})]\n"
        "print(','.join(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"{module} imported {result.stdout.strip()}"
