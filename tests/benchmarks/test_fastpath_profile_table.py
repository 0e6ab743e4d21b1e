"""benchmarks/fastpath_profile_table.py: a profile's parts per call of ``serve_record``, from a real cProfile."""

from __future__ import annotations

import cProfile
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fastpath_profile_table.py"

RECORDS = '''
def write_answer(n):
    return sum(range(n))

def serve_record(n):
    return write_answer(n) + sum(range(n))
'''


def load(path: Path, source: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"under_test_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_parts_are_per_record(tmp_path: Path) -> None:
    records = load(tmp_path / "fastpath" / "records.py", RECORDS)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(7):
        records.serve_record(20_000)
    profile.disable()
    profile.dump_stats(tmp_path / "fastpath.prof")
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "fastpath.prof")], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.startswith("records 7"), out
    us = {m[1].strip(): float(m[2]) for m in re.finditer(r"^  (.+?)\s+([\d.]+) us$", out, re.M)}
    assert 0 < us["reply (write_answer)"] < us["whole record (serve_record)"], out
    assert us["of it the core (manager.append)"] == 0.0, out  # not in this profile


def test_a_profile_without_records_says_so(tmp_path: Path) -> None:
    profile = cProfile.Profile()
    profile.enable()
    sum(range(10))
    profile.disable()
    profile.dump_stats(tmp_path / "empty.prof")
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "empty.prof")], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "records 0"
