"""PNG plots of a suite's results (matplotlib, headless Agg backend)."""

from __future__ import annotations

import os

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_vs_concurrency(serve_runs: list[dict], baselines: list[dict], path: str) -> str:
    """serve_runs: {max_concurrency, metrics}; baselines drawn as horizontal lines."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    runs = sorted(serve_runs, key=lambda r: r["max_concurrency"])
    xs = [r["max_concurrency"] for r in runs]
    ax.plot(xs, [r["metrics"]["output_throughput"] for r in runs], "o-", label="pagemill (output tok/s)")
    for b, style in zip(baselines, ["--", ":", "-."]):
        ax.axhline(b["output_throughput"], linestyle=style, color="gray", label=f"{b['name']} ({b['output_throughput']:.0f})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("max concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Output-token throughput vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def latency_cdfs(serve_runs: list[dict], path: str) -> str:
    """CDFs of TTFT, TPOT and E2E latency per concurrency level (needs per-request values)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), dpi=100)
    for r in sorted(serve_runs, key=lambda r: r["max_concurrency"]):
        for ax, key in zip(axes, ["ttft_ms", "tpot_ms", "e2el_ms"]):
            v = np.sort(np.asarray(r["per_request"][key], dtype=float))
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=f"c={r['max_concurrency']}")
    for ax, title in zip(axes, ["TTFT (ms)", "TPOT (ms)", "E2E latency (ms)"]):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Latency CDFs")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def sweep_plot(points: list[dict], path: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    bs = [p["batch_size"] for p in points]
    ax.plot(bs, [p["decode_tok_s"] for p in points], "o-", label="decode tok/s")
    ax2 = ax.twinx()
    ax2.plot(bs, [p["decode_ms"] for p in points], "s--", color="tab:red", label="decode step ms")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens / s")
    ax2.set_ylabel("decode step (ms)", color="tab:red")
    ax.set_title("Shard decode sweep (no HTTP/gRPC)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def all_plots(results: dict, out_dir: str) -> list[str]:
    made = []
    os.makedirs(out_dir, exist_ok=True)
    serve = results.get("serve", [])
    if serve:
        made.append(throughput_vs_concurrency(serve, results.get("baselines", []),
                                              os.path.join(out_dir, "throughput_vs_concurrency.png")))  # fmt: skip
        made.append(latency_cdfs(serve, os.path.join(out_dir, "latency_cdfs.png")))
    if results.get("sweep"):
        made.append(sweep_plot(results["sweep"], os.path.join(out_dir, "shard_sweep.png")))
    return made
