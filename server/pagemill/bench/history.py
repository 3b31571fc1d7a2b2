"""A benchmark's history: one JSON line per run in `<out>/history.jsonl`.

A results folder holds the latest run whole (`pagemill bench compare` writes compare.json,
compare.md and compare.png, replaced by every run) and, beside it, this file, which every run
appends one row to: when it ran, on which commit, on which CPU, and each server's headline
figures. The folder is the benchmark's page; the file is its record over time (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

HISTORY_FILE = "history.jsonl"
# The CPU flags that decide which kernel paths run (docs/cpu.md), recorded with every row.
HISTORY_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
# A server's headline figures in a row: compare's summary key -> the row's key.
SERVER_FIGURES = {"output_tok_s": "output_tok_s", "ttft_p50_ms": "ttft_p50_ms", "ttft_p99_ms": "ttft_p99_ms",
                  "tpot_p50_ms": "tpot_p50_ms", "batch1_ms_per_token": "batch1_ms_per_token",
                  "batch1_floor_ms": "batch1_floor_ms", "rss_mib": "rss_mib"}  # fmt: skip
# The workload's arguments that a row keeps (which run it was, not how it was started).
WORKLOAD_ARGS = ("num_prompts", "concurrency", "input_min", "input_max", "output_min", "output_max",
                 "batch1_prompts", "batch1_input_len", "batch1_output_len", "runs", "seed")  # fmt: skip


def git_commit(path: str | os.PathLike | None = None) -> str | None:
    """The commit of the pagemill checkout at `path` (default: the one this package runs from),
    or None where that is not a pagemill checkout (an installed wheel) or git is missing."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=where, capture_output=True,
                             text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or not (Path(lines[0]) / "server" / "pagemill").is_dir():
        return None
    return lines[1]


def cpu_record(cpu: dict) -> dict:
    """Model name, logical CPUs and which of HISTORY_FLAGS the CPU has (compare_report.parse_cpuinfo's dict)."""
    flags = set(cpu.get("flags") or [])
    return {"model": cpu.get("model", ""), "cpus": cpu.get("cpus"), "flags": [f for f in HISTORY_FLAGS if f in flags]}


def _round(v):
    return round(v, 3) if isinstance(v, float) else v


def server_record(server: dict) -> dict:
    """One server's headline figures (medians over its runs) from a compare result's server entry."""
    s = server.get("summary") or {}
    row = {"precision": server.get("precision")}
    row.update({key: _round(s.get(src)) for src, key in SERVER_FIGURES.items()})
    row["runs"] = s.get("runs", 0)
    row["tokens_ok"] = s.get("tokens_ok")
    if server.get("merged_from"):
        row["merged_from"] = server["merged_from"]
    return row


def history_row(res: dict, commit: str | None, now: datetime | None = None) -> dict:
    """The row a compare result adds to its history (`res` as compare.write leaves it: summaries
    and ratios filled in)."""
    now = now or datetime.now(timezone.utc)
    args = res.get("args") or {}
    return {
        "date": now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit,
        "cpu": cpu_record(res.get("cpu") or {}),
        "command": res.get("command"),
        "workload": {k: args[k] for k in WORKLOAD_ARGS if k in args},
        "read_bandwidth_gbs": _round(res.get("read_bandwidth_gbs")),
        "servers": {s["name"]: server_record(s) for s in res.get("servers", [])},
        "ratios": {name: {k: _round(v) for k, v in r.items()} for name, r in (res.get("ratios") or {}).items()},
    }


def append_history(out: str | os.PathLike, row: dict) -> Path:
    """Appends `row` as one line to `<out>/history.jsonl`; returns the file's path."""
    path = Path(out) / HISTORY_FILE
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=False, separators=(",", ":")) + "\n")
    return path


def read_history(path: str | os.PathLike) -> list[dict]:
    """Every row of a history file, oldest first (blank lines skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
