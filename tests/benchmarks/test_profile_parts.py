"""benchmarks/profile_parts.py: a profile's named functions, per call of the first part."""

from __future__ import annotations

import cProfile
import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_parts.py"

RECORDS = '''
def write_answer(n):
    return sum(range(n))

def serve_record(n):
    return write_answer(n) + sum(range(n))
'''


def test_parts_are_per_call_of_the_first_part(tmp_path: Path) -> None:
    module_file = tmp_path / "records.py"
    module_file.write_text(RECORDS)
    spec = importlib.util.spec_from_file_location("records_under_test", module_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(7):
        module.serve_record(20_000)
    module.write_answer(10)  # a call outside a record: counted, and still divided by the records
    profile.disable()
    profile.dump_stats(tmp_path / "fastpath.prof")
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "fastpath.prof"),
                          "--parts", "records.py:serve_record,records.py:write_answer,nowhere.py:serve_record"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith("7 records"), out
    whole, answer, missing = (float(line.split()[1]) for line in lines[1:4])
    assert "(7 calls)" in lines[1] and "(8 calls)" in lines[2] and "(0 calls)" in lines[3], out
    assert 0 < answer < whole and missing == 0.0, out


def test_a_profile_without_the_first_part_is_an_error(tmp_path: Path) -> None:
    profile = cProfile.Profile()
    profile.enable()
    sum(range(10))
    profile.disable()
    profile.dump_stats(tmp_path / "empty.prof")
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "empty.prof")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and "no calls of records.py:serve_record" in result.stderr
