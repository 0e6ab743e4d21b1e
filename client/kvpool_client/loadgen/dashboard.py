"""The progress bar (stderr, only on a terminal) and the end-of-run dashboard (plain text from the summary)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvpool_client.loadgen.prefix_summary import render_events, render_prefix
from kvpool_client.loadgen.tenants import render_tenants


class ProgressBar:
    """rich's progress bar on stderr (only on a terminal): ``━━━━━━╸━━━  42/100 completions  12,345 tokens  0:00:03``,
    redrawn by rich at most 10 times a second."""

    def __init__(self, total: int, *, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total = total
        self._progress: Progress | None = None
        if self.enabled:
            console = Console(file=self.stream, force_terminal=True)
            self._progress = Progress(
                BarColumn(bar_width=30), MofNCompleteColumn(), TextColumn("completions"),
                TextColumn("{task.fields[tokens]:>9,} tokens"), TimeElapsedColumn(),
                console=console, refresh_per_second=10, transient=False)
            self._task = self._progress.add_task("run", total=total, tokens=0)
            self._progress.start()

    def update(self, done: int, tokens: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done, tokens=tokens)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.refresh()
            self._progress.stop()
            self._progress = None


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 20):,.2f} MiB"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _invariants(end: dict[str, Any]) -> str:
    if not end.get("invariants_checked", True):
        return f"not checked ({end.get('invariants_error') or 'CheckInvariants needs an admin token'})"
    return "ok" if end["invariants_ok"] else "VIOLATED: " + end.get("invariants_error", "")


def render(summary: dict[str, Any]) -> str:
    """The dashboard as text."""
    cfg, run, ver, mem = summary["config"], summary["run"], summary["verification"], summary["memory"]
    lat = summary["latency"]
    mode = cfg["mode"] + (f" (beam width {cfg['beam_width']})" if cfg["mode"] == "beam" else "")
    mode += f" ({cfg['num_samples']} samples)" if cfg["mode"] == "parallel" else ""
    bb = mem["block_bytes"]
    lines = [
        "=" * 78,
        f" kvpool-loadgen  {cfg['target']}  backend={cfg['backend']}  mode={mode}",
        f" {cfg['processes']} processes, {cfg['concurrency']} requests in flight, lengths={cfg['lengths']} "
        f"(max_len {cfg['max_len']}), seed={cfg['seed']}",
        f" pool: {mem['pool_blocks']:,} blocks x {cfg['block_size']} tokens x {cfg['token_bytes']} B/token "
        f"= {_mib(mem['pool_blocks'] * bb)}",
        "-" * 78,
        f" completions            {run['completions']:>10,} / {cfg['completions']}   "
        f"({run['sequences']:,} sequences, {run['wall_s']:.2f} s)",
        f" token appends          {run['tokens_appended']:>10,}   in {run['append_calls']:,} AppendToken calls "
        f"({run['decode_steps']:,} decode steps)",
        f" KV verification errors {ver['errors']:>10,}   ({ver['tokens_verified']:,} tokens checked via "
        f"{ver['method']})"
        + (f"  [{ver['errors_injected']} injected by --inject-errors]" if ver.get("errors_injected") else ""),
        "-" * 78,
        f" utilization            peak {_pct(mem['peak_utilization']):>8}  ({mem['peak_used_blocks']:,} blocks, "
        f"{_mib(mem['peak_used_bytes'])})   time-avg {_pct(mem['avg_utilization'])}",
        f" internal fragmentation at peak {_pct(mem['internal_fragmentation_at_peak']):>8}   "
        f"time-avg {_pct(mem['internal_fragmentation_avg'])}",
        f" external fragmentation {_pct(mem['external_fragmentation']):>8}   (fixed-size blocks, no contiguity: "
        "any free block fits)",
        f" peak memory: paged {_mib(mem['peak_used_bytes'])} vs naive preallocation "
        f"{_mib(mem['naive_peak_bytes'])}",
        f"   naive = {cfg['naive_seqs']} sequences x {cfg['max_len']} tokens ({mem['naive_blocks_per_seq']} blocks "
        f"each) = {mem['naive_peak_blocks']:,} blocks;  paged/naive = {mem['paged_over_naive_peak']:.3f}",
        f" KV memory holding tokens (time-avg): paged {_pct(mem['kv_used_for_tokens_paged'])}, "
        f"naive {_pct(mem['kv_used_for_tokens_naive'])}",
    ]
    share = summary.get("sharing")
    if share and cfg["mode"] != "plain":
        lines += [
            "-" * 78,
            f" sharing: blocks saved vs no sharing  time-avg {_pct(share['blocks_saved_avg'])}   at peak "
            f"{_pct(share['blocks_saved_at_peak'])} ({share['peak_blocks_with_sharing']:,} vs "
            f"{share['peak_blocks_without_sharing']:,} blocks)",
            f"          forks {share['forks']:,}   copy-on-write copies {share['copies']:,}",
        ]
    lines += render_prefix(summary)
    if cfg.get("workload", "standard") != "standard":
        lines += render_events(summary)
    tenant_lines = render_tenants(summary.get("tenants") or {})
    if tenant_lines:
        lines += ["-" * 78, *tenant_lines]
    lines += ["-" * 78, " RPC latency (ms)          count      p50      p99"]
    for name, row in lat.items():
        if row["count"]:
            lines.append(f"   {name:<20} {row['count']:>9,} {row['p50_ms']:>8.3f} {row['p99_ms']:>8.3f}")
    end = summary["end"]
    lines += [
        "-" * 78,
        f" at the end: {end['blocks_used']} blocks used, {end['sequences']} sequences; invariants "
        f"{_invariants(end)}",
    ]
    if ver["messages"]:
        lines += [" verification failures:"] + [f"   {m}" for m in ver["messages"]]
    if summary.get("worker_errors"):
        lines += [" worker failures:"] + [f"   {m.strip().splitlines()[-1]}" for m in summary["worker_errors"]]
    kv = summary.get("kv_path") or {}
    if kv.get("path") in ("grpc", "mixed"):
        lines.append(f" KV over gRPC (WriteKV / ReadKV) in {kv['grpc_processes']} process(es), not the mapped "
                         f"pool: {'; '.join(kv['why'])}")
    interrupted = f" (interrupted by {summary['interrupted']})" if summary.get("interrupted") else ""
    lines.append(f" result: {'PASS' if summary['ok'] else 'FAIL'}{interrupted}")
    lines.append("=" * 78)
    return "\n".join(lines)
