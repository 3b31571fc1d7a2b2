"""Resident memory of a GGUF model served kept quantized, against the file's size.

    PYTHONPATH=server python3 benchmarks/gguf_memory.py [--model FILE.gguf] [--context 1024]

As a shard loads it (load_model, the shard's malloc settings, a KV pool of --context tokens),
in this process: resident set (psutil; anonymous and file-backed apart, /proc) after the imports
(the baseline every shard pays: Python, torch), after loading, after the pool, and after a
prefill of 256 tokens and 32 decode steps; the peak is VmHWM (since the process started: the
imports' peak is below the baseline's). Resetting it through /proc/self/clear_refs changed how
much freed memory glibc kept (600 MB more here), so it is not reset. The model's
share is the increase over the baseline; the target is 1.25 x the file size plus the pool.
Writes benchmarks/results/gguf-memory/latest.json and appends the run to history.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import psutil
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from int8_quality import BLOCK, Sequence  # noqa: E402

GEMMA = Path(os.environ.get("PAGEMILL_PEERS", "/opt/pagemill-peers")) / "models" / "gemma-3-270m-q4_k_m.gguf"
MIB = 1 << 20


def status() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


def mapped(path: str) -> int:
    """Resident bytes of the mappings of `path` (the GGUF's pages this process has touched and the
    kernel has not reclaimed: clean file pages, dropped first under memory pressure)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if not line[:1].isupper() or ":" not in line.split()[0]:  # a mapping's header line
            inside = line.split()[-1] == path if len(line.split()) >= 6 else False
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def snapshot(tag: str, base: dict[str, int] | None, path: str = "") -> dict[str, int]:
    s = status()
    s["rss"] = psutil.Process().memory_info().rss
    s["gguf_mapped"] = mapped(path) if path else 0
    extra = "" if base is None else f" (+{(s['rss'] - base['rss']) / MIB:.0f} MiB over the baseline)"
    print(f"{tag:34s} RSS {s['rss'] / MIB:7.1f} MiB (anon {s['RssAnon'] / MIB:6.1f}, file {s['RssFile'] / MIB:6.1f}, "
          f"of it the GGUF {s['gguf_mapped'] / MIB:6.1f}), peak {s['VmHWM'] / MIB:7.1f}{extra}", flush=True)  # fmt: skip
    return s


@torch.no_grad()
def next_token(seq: Sequence, ids: list[int]) -> int:
    """Sequence.step, with logits for the last token only (what a shard samples from)."""
    from pagemill.attention.metadata import make_metadata

    n, start = len(ids), seq.len
    seq.len += n
    slots = [seq.table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, seq.len)]
    meta = make_metadata(is_prefill=start == 0 or n > 1, query_lens=[n], kv_lens=[seq.len],
                         block_tables=[seq.table], slot_mapping=slots, device="cpu")  # fmt: skip
    hidden = seq.model(torch.tensor(ids), torch.arange(start, seq.len), meta, seq.pool.kv_caches)
    return int(seq.model.compute_logits(hidden[-1:])[0].argmax())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(GEMMA))
    p.add_argument("--context", type=int, default=1024, help="tokens the KV pool holds")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-kernels", action="store_true")
    a = p.parse_args()
    from pagemill.models.gguf.linear import GGUFLinear
    from pagemill.models.gguf.reader import GGUFModel
    from pagemill.models.loader import load_model
    from pagemill.shard.malloc_tuning import keep_freed_memory

    keep_freed_memory()  # as the shard does
    file_bytes = GGUFModel(a.model).total_bytes()
    base = snapshot("baseline (imports)", None)
    t0 = time.perf_counter()
    model, config = load_model(a.model, a.dtype, "cpu", cpu_kernels=not a.no_kernels)
    load_s = time.perf_counter() - t0
    loaded = snapshot("model loaded", base, a.model)
    seq = Sequence(model, config, getattr(torch, a.dtype), a.context)
    pool_bytes = sum(t.nbytes for pair in seq.pool.kv_caches for t in pair)
    pooled = snapshot("KV pool allocated", base, a.model)
    ids = list(range(100, 356))
    t0 = time.perf_counter()
    out = [next_token(seq, ids)]
    for _ in range(32):
        out.append(next_token(seq, [out[-1]]))
    step_s = (time.perf_counter() - t0) / 33
    steady = snapshot("after 256-token prefill + 32 steps", base, a.model)
    kernel = sum(m.prepared is not None for m in model.modules() if isinstance(m, GGUFLinear))
    model_bytes = steady["rss"] - base["rss"] - (pooled["rss"] - loaded["rss"])
    result = {
        "model": a.model, "file_bytes": file_bytes, "dtype": a.dtype, "kernel_linears": kernel,
        "path": "compiled kernels" if kernel else "torch reference", "baseline_rss": base["rss"],
        "loaded_rss": loaded["rss"], "gguf_mapped_loaded": loaded["gguf_mapped"],
        "gguf_mapped_steady": steady["gguf_mapped"], "anon_over_baseline_steady": steady["RssAnon"] - base["RssAnon"], "pool_rss": pooled["rss"] - loaded["rss"], "steady_rss": steady["rss"],
        "peak_rss": steady["VmHWM"], "model_share_steady": (loaded["rss"] - base["rss"]) / file_bytes,
        "model_share_after_steps": model_bytes / file_bytes, "peak_over_baseline": (steady["VmHWM"] - base["rss"]) / file_bytes,
        "load_seconds": load_s, "seconds_per_forward": step_s, "kv_pool_bytes": pool_bytes,
        "target_bytes": 1.25 * file_bytes + pool_bytes, "over_baseline_steady": steady["rss"] - base["rss"],
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "command": " ".join(sys.argv),
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k.endswith(("share_steady", "after_steps", "over_baseline"))}))
    out_dir = HERE / "results" / "gguf-memory"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "latest.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(out_dir / "history.jsonl", "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **result}) + "\n")


if __name__ == "__main__":
    main()
