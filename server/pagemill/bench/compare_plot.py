"""PNG of a compare run: throughput, TTFT and per-token latency per server."""

from __future__ import annotations

import numpy as np


def compare_plot(servers: list[dict], cpu_line: str, concurrency: int, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["name"] for s in servers]
    sums = [s["summary"] for s in servers]
    x = np.arange(len(names))

    def col(key):
        return [s.get(key) or 0.0 for s in sums]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), dpi=100)
    ax = axes[0]
    bars = ax.bar(x, col("output_tok_s"), color=["tab:red" if not s["tokens_ok"] else "tab:blue" for s in sums])
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_title(f"output tok/s at {concurrency} concurrent (red: short outputs)")
    w = 0.4
    axes[1].bar(x - w / 2, np.array(col("ttft_p50_ms")) / 1e3, w, label="TTFT p50")
    axes[1].bar(x + w / 2, np.array(col("ttft_p99_ms")) / 1e3, w, label="TTFT p99")
    axes[1].set_title(f"time to first token at {concurrency} concurrent (s)")
    axes[2].bar(x - w / 2, col("tpot_p50_ms"), w, label=f"TPOT p50 at c={concurrency}")
    axes[2].bar(x + w / 2, col("batch1_ms_per_token"), w, label="batch-1 ms/token")
    axes[2].set_title("time per output token (ms)")
    for ax in axes:
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[1].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.suptitle(cpu_line, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
