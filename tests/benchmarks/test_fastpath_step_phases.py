"""benchmarks/fastpath_step_phases.py still runs and prints its four figures (nothing here is timed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_fastpath_step_phases_prints_every_phase() -> None:
    result = subprocess.run([sys.executable, "fastpath_step_phases.py"], cwd=BENCHMARKS, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for label in ("core append (token ids)", "record round (token ids)", "record round (no token ids)"):
        assert re.search(rf"^{re.escape(label)}\s+quiet p50\s+[\d.]+\s+fill\s+[\d.]+\s+seal\s+[\d.]+\s+mean\s+[\d.]+$",
                         result.stdout, re.M), result.stdout
    assert re.search(r"^record round \(token ids, staggered\)\s+p50\s+[\d.]+\s+p90", result.stdout, re.M), result.stdout
