"""One Python floor, said the same everywhere (issue 19, item 6): the project's requires-python and classifiers,
and the README, agree, and the floor is at least 3.11 (tomllib, asyncio.Task.uncancel())."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECTS = [ROOT / "pyproject.toml"]  # the one project (its extras are the server, the GPU, vLLM)


def floor_of(pyproject: Path) -> tuple[int, int]:
    spec = tomllib.loads(pyproject.read_text())["project"]["requires-python"]
    match = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert match, f"{pyproject}: requires-python {spec!r} is not a plain '>=3.N'"
    return 3, int(match[1])


def test_every_package_declares_the_same_floor_of_at_least_3_11():
    floors = {floor_of(p) for p in PYPROJECTS}
    assert len(floors) == 1, floors
    assert floors.pop() >= (3, 11)


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: p.parent.name)
def test_classifiers_start_at_the_floor(pyproject):
    floor = floor_of(pyproject)
    classifiers = tomllib.loads(pyproject.read_text())["project"]["classifiers"]
    pattern = re.compile(r"Programming Language :: Python :: 3\.(\d+)")
    versions = [(3, int(m[1])) for c in classifiers if (m := pattern.fullmatch(c))]
    assert versions and min(versions) == floor, versions


def test_the_readme_says_the_same_floor_and_why():
    floor = floor_of(PYPROJECTS[0])
    readme = " ".join((ROOT / "README.md").read_text().split())
    said = {(3, int(m)) for m in re.findall(r"Python (?:≥|>=) ?3\.(\d+)", readme)}
    assert said == {floor}, said
    assert "tomllib" in readme and "uncancel" in readme


def test_this_interpreter_meets_the_floor():
    assert sys.version_info[:2] >= floor_of(PYPROJECTS[0])
