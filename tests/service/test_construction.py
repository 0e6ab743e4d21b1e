"""The service is built whole (issue 19): every dependency goes to a constructor, no module wires an object after
building it, and the core has no function that reaches into the manager's private parts."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server" / "kvpool_server"
# objects of the service and its transports: their attributes are set in their own constructors only
BUILT_WHOLE = {"service", "servicer", "handle", "guard", "scope", "sessions", "admission", "events", "feed"}


def _attribute_stores(tree: ast.AST) -> list[tuple[str, str, int]]:
    stores = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                stores.append((target.value.id, target.attr, node.lineno))
    return stores


def test_no_module_sets_an_attribute_of_the_service_after_building_it():
    found = [f"{path.relative_to(SERVER)}:{line}: {name}.{attr} = ..."
             for path in sorted(SERVER.rglob("*.py"))
             for name, attr, line in _attribute_stores(ast.parse(path.read_text()))
             if name in BUILT_WHOLE]
    assert found == [], "wired after construction: " + "; ".join(found)


def test_the_service_classes_set_their_dependencies_only_in_init():
    """Callables and collaborators of the service classes are constructor arguments, never assigned later (the
    state they keep -- a drain flag, a subscriber count -- may change)."""
    classes = {"KVPoolService", "SessionService", "CoreGuard", "CallScope", "EventFeed", "Call"}
    state = {"draining", "num_subscribers", "_published", "status", "caller"}
    found = []
    for path in sorted((SERVER / "service").glob("*.py")):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)
                    and n.name in classes):
            for method in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"):
                found += [f"{path.name}:{line}: {cls.name}.{method.name} sets self.{attr}"
                          for name, attr, line in _attribute_stores(method) if name == "self" and attr not in state]
    assert found == [], "; ".join(found)


def test_no_core_function_takes_the_manager_to_call_its_private_methods():
    found = []
    for path in sorted((SERVER / "core").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and isinstance(node.value, ast.Name) and node.value.id == "manager":
                found.append(f"{path.name}:{node.lineno}: manager.{node.attr}")
    assert found == [], "; ".join(found)
