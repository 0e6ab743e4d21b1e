"""The root project's dependencies and extras (pyproject.toml) against the pins of requirements/*.txt that make, CI
and the images install (issue 35 item 1): each pinned file names exactly the packages of its part of the project."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# requirements file -> the part of the project it pins (None: the project's own dependencies).
PINNED_PARTS = {"client.txt": None, "server.txt": "server", "gpu.txt": "gpu", "loadgen.txt": "loadgen"}


def _name(spec: str) -> str:
    return re.split(r"[=<>!~\[; ]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def pinned_names(file: str) -> set[str]:
    """The packages a requirements file pins itself (its `-r` includes left out)."""
    lines = [line.split("#", 1)[0].strip() for line in (ROOT / "requirements" / file).read_text().splitlines()]
    return {_name(line) for line in lines if line and not line.startswith("-")}


@pytest.mark.parametrize("file", PINNED_PARTS)
def test_each_pinned_file_names_the_packages_of_its_part(file):
    part = PINNED_PARTS[file]
    declared = PROJECT["dependencies"] if part is None else PROJECT["optional-dependencies"][part]
    assert pinned_names(file) == {_name(spec) for spec in declared}, f"requirements/{file} vs {part or 'dependencies'}"


def test_every_pin_satisfies_the_projects_floor():
    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = {}
    for file in PINNED_PARTS:
        for line in (ROOT / "requirements" / file).read_text().splitlines():
            if "==" in (line := line.split("#", 1)[0].strip()):
                name, version = line.split("==")
                pins[_name(name)] = Version(version.strip())
    specs = PROJECT["dependencies"] + [s for extra in PROJECT["optional-dependencies"].values() for s in extra]
    for spec in map(Requirement, specs):
        if spec.name in pins:
            assert spec.specifier.contains(pins[spec.name]), f"{spec} does not admit the pinned {pins[spec.name]}"


def test_the_cuda13_extra_is_the_cuda12_one_for_cuda_13():
    gpu, gpu13 = PROJECT["optional-dependencies"]["gpu"], PROJECT["optional-dependencies"]["gpu-cuda13"]
    assert [_name(s) for s in gpu] == ["cupy-cuda12x"] and [_name(s) for s in gpu13] == ["cupy-cuda13x"]


def test_console_scripts_point_at_functions_that_exist():
    import importlib

    for script, target in PROJECT["scripts"].items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), script
