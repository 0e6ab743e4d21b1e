"""--tenants N: the tokens file, which token each process calls with, and the per-tenant summary.

The tokens file (``--token-file`` or KVPOOL_TOKEN_FILE) has one ``TENANT TOKEN`` per line (blank lines and ``#``
comments skipped); the first N lines are the run's tenants. Worker process i calls with tenant i % N's token. The
Stats sampler reads each tenant's usage with that tenant's token (Stats shows a frontend its own tenant), or with
one ``--admin-token`` (an admin sees every tenant).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpool_client.loadgen.metrics import time_weighted_mean


class TokenFileError(ValueError):
    pass


def read_token_file(path: str | Path, count: int) -> list[tuple[str, str]]:
    """The first ``count`` (tenant, token) pairs of ``path``; TokenFileError if it has fewer or a bad line."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise TokenFileError(f"cannot read the token file {path}: {error.strerror}") from error
    pairs: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenFileError(f"{path}:{number}: expected 'TENANT TOKEN', got {len(parts)} fields")
        if parts[0] in (tenant for tenant, _ in pairs):
            raise TokenFileError(f"{path}:{number}: tenant {parts[0]!r} appears twice")
        pairs.append((parts[0], parts[1]))
    if len(pairs) < count:
        raise TokenFileError(f"--tenants {count} needs {count} 'TENANT TOKEN' lines in {path}; it has {len(pairs)}")
    return pairs[:count]


def worker_token(tenants: Sequence[tuple[str, str]], worker_id: int, token: str | None) -> tuple[str, str | None]:
    """(tenant, token) of worker process ``worker_id``: tenant i % N's, or ("", --token) without --tenants."""
    if not tenants:
        return "", token
    return tenants[worker_id % len(tenants)]


def tenant_of(tenants: Sequence[tuple[str, str]], token: str | None) -> str:
    """The tenant whose token ``token`` is ("" when not one of ``tenants``)."""
    return next((name for name, tok in tenants if tok == token), "")


def tenant_summary(
    tenant_series: dict[str, dict[str, list[float]]],
    quotas: dict[str, int | None],
    workers: Sequence[dict[str, Any]],
    t0: float,
    t1: float,
    process_tenants: Sequence[str] = (),
) -> dict[str, dict[str, Any]]:
    """Per tenant: blocks held (peak and time-average over [t0, t1], from the sampler's TenantUsage), live
    sequences, its max_blocks quota (None: no limit; 0: none allowed), and its processes' counts (completions, sequences, quota refusals);
    ``workers``: the workers' summaries (a failed one's counts so far too), ``process_tenants``: each process's."""
    out: dict[str, dict[str, Any]] = {}
    for name, series in tenant_series.items():
        t = np.asarray(series["t"], dtype=np.float64)
        blocks = np.asarray(series["blocks"], dtype=np.float64)
        seqs = np.asarray(series["seqs"], dtype=np.float64)
        mine = [w for w in workers if w.get("tenant") == name]
        counts: dict[str, int] = {}
        for w in mine:
            for key, value in w["counts"].items():
                counts[key] = counts.get(key, 0) + value
        out[name] = {
            "processes": sum(1 for tenant in process_tenants if tenant == name),
            "max_blocks": quotas.get(name),
            "peak_blocks": int(blocks.max()) if blocks.size else 0,
            "avg_blocks": time_weighted_mean(t, blocks, t0, t1),
            "peak_sequences": int(seqs.max()) if seqs.size else 0,
            "avg_sequences": time_weighted_mean(t, seqs, t0, t1),
            "completions": counts.get("completions", 0),
            "sequences": counts.get("sequences", 0),
            "tokens_appended": counts.get("tokens_appended", 0),
            "quota_refusals": counts.get("quota_refusals", 0),
            "resource_exhausted_retries": counts.get("exhausted_retries", 0),
            "stats_samples": int(t.size),
        }
    return out


def render_tenants(tenants: dict[str, dict[str, Any]]) -> list[str]:
    """The dashboard's per-tenant table (no lines without --tenants)."""
    if not tenants:
        return []
    lines = [" tenant           procs  blocks peak (quota)  time-avg  seqs peak  completions  sequences  "
             "quota refusals"]
    for name, u in tenants.items():
        quota = "(-)" if u["max_blocks"] is None else f"({u['max_blocks']})"  # -: no limit
        lines.append(
            f"   {name:<14} {u['processes']:>5} {u['peak_blocks']:>7,} {quota:<8} {u['avg_blocks']:>10.1f} "
            f"{u['peak_sequences']:>10,} {u['completions']:>12,} {u['sequences']:>10,} {u['quota_refusals']:>15,}"
        )
    return lines
