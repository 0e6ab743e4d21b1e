"""Which way imports point: the core imports neither grpc nor cupy; the device layer imports no grpc; kvpool-common's
layout and shm modules import neither; the server never imports the client library."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("kvpool_server.core", ("grpc", "cupy", "google.protobuf")),
        ("kvpool_server.device", ("grpc", "google.protobuf")),
        ("kvpool.layout", ("grpc", "cupy", "google.protobuf")),
        ("kvpool.shm", ("grpc", "cupy", "google.protobuf")),
        ("kvpool.block_hash", ("grpc", "cupy", "google.protobuf")),
        ("kvpool_server.main", ("kvpool_client",)),
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


def test_server_source_never_imports_the_client_library():
    """Static, so an import inside a function that the runtime check above does not reach is caught too."""
    import ast
    from pathlib import Path

    server = Path(__file__).resolve().parents[2] / "server"
    offenders = []
    for path in server.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(server)}: {n}" for n in names if n.split(".")[0] == "kvpool_client"]
    assert offenders == []
