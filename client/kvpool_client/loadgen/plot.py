"""The PNG: KV memory in use over time, paged against naive preallocation (and against no sharing)."""

from __future__ import annotations

from typing import Any


def plot_memory(summary: dict[str, Any], path: str) -> None:
    import matplotlib  # noqa: PLC0415  (only the plot needs matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    series = summary["series"]
    stats, cfg, mem = series["stats"], summary["config"], summary["memory"]
    mib = mem["block_bytes"] / (1 << 20)
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    live = series.get("sequences") or stats  # the workers' records, else the sampler's
    naive = [s * mem["naive_blocks_per_seq"] * mib for s in live["seqs"]]
    ax.step(live["t"], naive, where="post", color="tab:red", label=f"naive preallocation ({cfg['max_len']} tok/seq)")
    if cfg["mode"] != "plain" and series.get("unshared"):
        un = series["unshared"]
        ax.step(un["t"], [b * mib for b in un["blocks"]], where="post", color="tab:orange", label="paged, no sharing")
    ax.step(stats["t"], [u * mib for u in stats["used"]], where="post", color="tab:blue", label="paged (kvpool)")
    token_mib = cfg["token_bytes"] / (1 << 20)
    stored = [(u * cfg["block_size"] - x) * token_mib for u, x in zip(stats["used"], stats["unused"], strict=True)]
    ax.step(stats["t"], stored, where="post", color="tab:green", linewidth=0.8, label="token KV actually stored")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("KV memory (MiB)")
    title = f"kvpool-loadgen: {cfg['mode']}, {cfg['concurrency']} in flight, {cfg['lengths']} lengths"
    ax.set_title(f"{title}\npeak paged/naive = {mem['paged_over_naive_peak']:.3f}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
