"""The PNG: KV memory in use over time, paged against naive preallocation (and against no sharing).

Two panels sharing the time axis:

    top     linear: what kvpool holds (paged, paged without sharing, token KV stored), the pool's capacity when it
            is on the same scale; naive preallocation only when it does not dwarf the paged lines
    bottom  log: every line, naive preallocation and the pool's capacity included

Legends sit outside the axes, never over the data. A run that failed says so in red in the title.
"""

from __future__ import annotations

from typing import Any

# Naive preallocation is drawn in the linear panel only when its peak is within this factor of paged's.
LINEAR_RANGE = 4.0


def lines(summary: dict[str, Any]) -> dict[str, tuple[list[float], list[float]]]:
    """label -> (t, MiB) for every line of the plot (step series, drawn where="post")."""
    series, cfg, mem = summary["series"], summary["config"], summary["memory"]
    stats = series["stats"]
    mib = mem["block_bytes"] / (1 << 20)
    live = series.get("sequences") or stats  # the workers' records, else the sampler's
    out = {
        "paged (kvpool)": (stats["t"], [u * mib for u in stats["used"]]),
        "token KV actually stored": (stats["t"], [(u * cfg["block_size"] - x) * cfg["token_bytes"] / (1 << 20)
                                                  for u, x in zip(stats["used"], stats["unused"], strict=True)]),
        f"naive preallocation ({cfg['max_len']} tok/seq)": (
            live["t"], [s * mem["naive_blocks_per_seq"] * mib for s in live["seqs"]]),
    }
    if cfg["mode"] != "plain" and series.get("unshared"):
        un = series["unshared"]
        out["paged, no sharing"] = (un["t"], [b * mib for b in un["blocks"]])
    return out


def pool_capacity_mib(summary: dict[str, Any]) -> float:
    return summary["end"]["blocks_total"] * summary["memory"]["block_bytes"] / (1 << 20)


def failure_reason(summary: dict[str, Any]) -> str:
    """'' for a run that passed; else a short reason for the plot's title."""
    if summary.get("ok", True):
        return ""
    run, cfg = summary["run"], summary["config"]
    if run["completions"] < cfg["completions"]:
        reason = f"{run['completions']} / {cfg['completions']} completed"
        if any("RESOURCE_EXHAUSTED" in e for e in summary.get("worker_errors", [])):
            reason += " (pool out of blocks)"
        return reason
    if summary["verification"]["errors"]:
        return f"{summary['verification']['errors']} KV verification errors"
    if not summary["end"]["invariants_ok"]:
        return "server invariants violated"
    return "worker failures" if summary.get("worker_errors") else "see the summary"


def plot_memory(summary: dict[str, Any], path: str) -> None:
    import matplotlib  # noqa: PLC0415  (only the plot needs matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    cfg, mem = summary["config"], summary["memory"]
    colors = {"paged (kvpool)": "tab:blue", "token KV actually stored": "tab:green", "paged, no sharing": "tab:orange"}
    data = lines(summary)
    capacity = pool_capacity_mib(summary)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), dpi=110, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    paged_peak = max((max(v, default=0.0) for k, (_, v) in data.items() if not k.startswith("naive")), default=0.0)
    for label, (t, values) in data.items():
        naive = label.startswith("naive")
        color = "tab:red" if naive else colors.get(label, "tab:gray")
        width = 0.8 if label.startswith("token") else 1.4
        if not naive or max(values, default=0.0) <= LINEAR_RANGE * max(paged_peak, 1e-12):
            top.step(t, values, where="post", color=color, linewidth=width, label=label)
        # zeros have no place on a log axis: gaps (NaN) instead of a fake floor
        bottom.step(t, [v if v > 0 else float("nan") for v in values], where="post", color=color, linewidth=width,
                    label=label)
    bottom.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"pool capacity ({capacity:,.2f} MiB)")
    if capacity <= LINEAR_RANGE * max(paged_peak, 1e-12):
        top.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"pool capacity ({capacity:,.2f} MiB)")
    else:
        top.text(1.02, 0.02, f"pool capacity {capacity:,.2f} MiB:\noff this scale (log panel)",
                 transform=top.transAxes, va="bottom", fontsize=8, color="dimgray")
    top.set_ylim(bottom=0)
    top.set_ylabel("KV memory (MiB)")
    bottom.set_yscale("log")
    positive = [v for _, values in data.values() for v in values if v > 0]
    if positive:
        bottom.set_ylim(bottom=min(positive) / 2, top=max(capacity, max(positive)) * 2)
    bottom.set_ylabel("MiB, log scale")
    bottom.set_xlabel("time since start (s)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    title = f"kvpool-loadgen: {cfg['mode']}, {cfg['concurrency']} in flight, {cfg['lengths']} lengths"
    title += f"\npeak paged/naive = {mem['paged_over_naive_peak']:.3f}"
    failed = failure_reason(summary)
    if failed:
        top.set_title(f"RUN FAILED: {failed}\n{title}", color="tab:red", fontweight="bold")
        for ax in (top, bottom):
            for spine in ax.spines.values():
                spine.set_edgecolor("tab:red")
    else:
        top.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
