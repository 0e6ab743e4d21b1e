#!/usr/bin/env python3
"""What scripts/image_smoke.sh requires of a load generator run inside a container: its ``--json`` summary.

    python3 scripts/image_smoke_check.py SUMMARY.json [--kv-path attach] [--fast-path]

Exit 0 and one line when the run passed, else 1 and one line per problem. A run passes when it says ``ok``, was
not interrupted, completed every request it was asked for, verified at least one token with 0 KV errors and no
failed check, had no worker errors, and left the pool empty with its invariants checked and holding.
``--kv-path attach`` also requires the pool to have been mapped (the container shared the server's IPC namespace);
``--fast-path`` requires appends over the shared-memory channel. Standard library only (runs on the host).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any


def problems(summary: dict[str, Any], *, kv_path: str | None = None, fast_path: bool = False) -> list[str]:
    """Everything wrong with one summary; empty when the run passed."""
    found: list[str] = []
    if summary.get("ok") is not True:
        found.append(f"ok is {summary.get('ok')!r}, not true")
    if summary.get("interrupted"):
        found.append(f"interrupted: {summary['interrupted']!r}")
    run = summary.get("run", {})
    asked = summary.get("config", {}).get("completions")
    if asked is not None and run.get("completions") != asked:
        found.append(f"{run.get('completions')} of {asked} requests completed")
    verification = summary.get("verification", {})
    if verification.get("errors") != 0:
        found.append(f"KV verification errors: {verification.get('errors')!r}")
    if verification.get("checks_failed"):
        found.append(f"verification checks failed: {verification['checks_failed']}")
    if not verification.get("tokens_verified"):
        found.append("no token was verified")
    if summary.get("worker_errors"):
        found.append(f"worker errors: {summary['worker_errors']!r}")
    end = summary.get("end", {})
    if not (end.get("invariants_checked") and end.get("invariants_ok")):
        found.append(f"pool invariants at the end: {end.get('invariants_error') or 'not checked'}")
    if end.get("blocks_used") or end.get("sequences"):
        found.append(f"left in the pool: {end.get('blocks_used')} blocks, {end.get('sequences')} sequences")
    if kv_path is not None and summary.get("kv_path", {}).get("path") != kv_path:
        found.append(f"KV path {summary.get('kv_path')!r}, not {kv_path}")
    if fast_path and not run.get("fast_path_appends"):
        found.append("no append went over the shared-memory fast path")
    return found


def describe(summary: dict[str, Any]) -> str:
    run, verification = summary.get("run", {}), summary.get("verification", {})
    return (f"{run.get('completions')} completions, {verification.get('tokens_verified')} tokens verified "
            f"({verification.get('method')}), {verification.get('errors')} KV errors, "
            f"KV path {summary.get('kv_path', {}).get('path')}, {run.get('fast_path_appends')} fast-path appends")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", help="the load generator's --json file")
    parser.add_argument("--kv-path", help="the KV path the run must have taken (attach, grpc)")
    parser.add_argument("--fast-path", action="store_true", help="require appends over the fast path")
    args = parser.parse_args(argv)
    try:
        with open(args.summary, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError) as error:
        print(f"image_smoke_check: cannot read {args.summary}: {error}")
        return 1
    found = problems(summary, kv_path=args.kv_path, fast_path=args.fast_path)
    for problem in found:
        print(f"image_smoke_check: FAIL: {problem}")
    if not found:
        print(f"image_smoke_check: PASS: {describe(summary)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
