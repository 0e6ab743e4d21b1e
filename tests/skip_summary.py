"""A pytest plugin (``pytest -p tests.skip_summary``, as ``make test`` runs it): one line at the end saying why tests
were skipped, grouped by reason, so "62 skipped" on a machine without a GPU is not a mystery.

    skipped 62: 48 no CUDA GPU (cupy not installed); 14 GPU-only: needs a CUDA device
"""

from __future__ import annotations

from collections import Counter

import pytest


def skip_reasons(reports: list[pytest.TestReport]) -> Counter[str]:
    """The reason of each skipped report ("Skipped: " prefix dropped), counted."""
    reasons: Counter[str] = Counter()
    for report in reports:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[reason.removeprefix("Skipped: ").strip() or "no reason given"] += 1
    return reasons


def format_summary(reasons: Counter[str], limit: int = 6) -> str:
    total = sum(reasons.values())
    parts = [f"{count} {reason}" for reason, count in reasons.most_common(limit)]
    rest = sum(count for _, count in reasons.most_common()[limit:])
    if rest:
        parts.append(f"{rest} for other reasons (pytest -rs lists them)")
    return f"skipped {total}: " + "; ".join(parts)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    reports = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "skipped", False)]
    if reports:
        terminalreporter.write_line(format_summary(skip_reasons(reports)))
