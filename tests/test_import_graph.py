"""No module of the client imports another in a circle (issue 19 item 5); the helper (tests/import_graph.py) is
checked on a small package first."""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import cycles, import_graph

ROOT = Path(__file__).resolve().parent.parent


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg"


def test_the_helper_finds_circles_through_every_kind_of_import(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.b import B\nA = 1\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..c import C  # lazy, relative\n",
        "c.py": "import pkg.a\nimport numpy\nC = 1\n",
        "d.py": "from pkg import sub, a\nfrom . import c\n",
    })
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.d"] == {"pkg.sub", "pkg.a", "pkg.c"}  # from a package: its submodule, or the package
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg"] == {"pkg.a"}
    assert cycles(pkg, "pkg") == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    assert cycles(pkg, "pkg", type_checking=False) == []


def test_no_client_module_imports_another_in_a_circle():
    found = cycles(ROOT / "client" / "kvpool_client", "kvpool_client")
    assert found == [], "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_server_module_imports_another_in_a_circle():
    """Issue 19: the layers point one way (docs/architecture.md), TYPE_CHECKING imports included."""
    found = cycles(ROOT / "server" / "kvpool_server", "kvpool_server")
    assert found == [], "import cycles: " + "; ".join(" -> ".join(c) for c in found)
