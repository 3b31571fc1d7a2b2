"""Batch-1 decode time per token of a GGUF served kept quantized, beside llama.cpp's llama-bench
on the same file, runs interleaved (pagemill, llama.cpp, pagemill, ...) so both see the same
machine load.

    PYTHONPATH=server python3 benchmarks/gguf_decode_speed.py --model FILE.gguf [--runs 3] [--tokens 64]

pagemill: each run a fresh process (the shard's model load: load_model, the torch attention
backend with the compiled CPU kernels, float32 activations as --dtype auto picks without
AVX512-BF16) that feeds BOS and then decodes --tokens greedy tokens through the paged pool, one
token per forward (llama-bench's tg: -p 0 -n N); its figure is the mean step time of the run.
The run also says which decode path runs (the fused whole-layer decode or per-op modules) and
splits a step into the fused layers (GGUFFusedDecoder: every decoder layer in one call), the
GGUF linears called one by one (QuantKernel.linear: the output head, and every linear where the
layers run per op), the embedding lookup and the rest (the final norm, rotary tables, argmax,
Python; per op also attention, norms, activations). llama.cpp: llama-bench
-m FILE -p 0 -n N -t THREADS, its tg figure as ms/token. Medians of the runs.
Writes benchmarks/results/gguf-decode-speed/latest.json and appends history.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "results" / "gguf-decode-speed"
PEERS = Path(os.environ.get("PAGEMILL_PEERS", "/opt/pagemill-peers"))  # benchmarks/peers/install.sh's folder
LLAMA_BENCH = PEERS / "bin" / "llama-bench"


def one_run(model: str, tokens: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from pagemill.attention.backend import select_backend
    from pagemill.attention.metadata import make_metadata
    from pagemill.cpu_kernels.quant import QuantKernel
    from pagemill.models.gguf.linear import GGUFLinear
    from pagemill.models.loader import load_model

    sys.path.insert(0, str(HERE))
    from int8_quality import BLOCK, Sequence

    t0 = time.perf_counter()
    net, config = load_model(model, "float32", "cpu", backend=select_backend("torch", "cpu", cpu_kernels=True),
                             cpu_kernels=True)  # fmt: skip
    load_s = time.perf_counter() - t0
    from pagemill.models.fused_decode import GGUFFusedDecoder

    spent = {"linear": 0.0, "embedding": 0.0, "fused": 0.0}
    for cls, name, key in ((QuantKernel, "linear", "linear"), (QuantKernel, "embedding", "embedding"),
                           (GGUFFusedDecoder, "__call__", "fused")):  # fmt: skip
        real = getattr(cls, name)

        def timed(self, *a, _real=real, _key=key, **k):
            t = time.perf_counter()
            try:
                return _real(self, *a, **k)
            finally:
                spent[_key] += time.perf_counter() - t

        setattr(cls, name, timed)
    seq = Sequence(net, config, torch.float32, tokens + 8)
    bos = config.bos_token_id if isinstance(config.bos_token_id, int) else 2
    steps, tok = [], bos
    with torch.no_grad():
        for i in range(tokens + 1):  # the first forward (BOS) is the prompt
            if i == 1:
                spent.update(linear=0.0, embedding=0.0, fused=0.0)
            t = time.perf_counter()
            n, start = 1, seq.len
            seq.len += 1
            slots = [seq.table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, seq.len)]
            meta = make_metadata(is_prefill=start == 0, query_lens=[1], kv_lens=[seq.len], block_tables=[seq.table],
                                 slot_mapping=slots, device="cpu")  # fmt: skip
            hidden = net(torch.tensor([tok]), torch.arange(start, seq.len), meta, seq.pool.kv_caches)
            tok = int(net.compute_logits(hidden[-1:])[0].argmax())
            if i:
                steps.append(time.perf_counter() - t)
    inner = net.model
    path = "fused whole-layer decode" if getattr(inner, "fused", None) is not None else "per-op modules"
    linears = [m for m in net.modules() if isinstance(m, GGUFLinear)]
    total = sum(steps)
    return {"ms_per_token": 1000 * total / len(steps), "median_step_ms": 1000 * statistics.median(steps),
            "load_s": load_s, "decode_path": path,
            "why": "GGUFFusedDecoder.build found a layer it does not compute (see models/fused_decode.py)"
                   if path == "per-op modules" else "",
            "linears_on_kernel": sum(m.on_kernel for m in linears), "linears": len(linears),
            "breakdown_ms": {"fused_layers": 1000 * spent["fused"] / len(steps),
                             "gguf_linears": 1000 * spent["linear"] / len(steps),
                             "embedding": 1000 * spent["embedding"] / len(steps),
                             "rest": 1000 * (total - sum(spent.values())) / len(steps)},
            "loadavg_after": loadavg()}  # fmt: skip


def llama_bench(model: str, tokens: int, threads: int) -> dict:
    out = subprocess.run([str(LLAMA_BENCH), "-m", model, "-p", "0", "-n", str(tokens), "-t", str(threads), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    row = json.loads(out)[0]
    return {"ms_per_token": 1000.0 / row["avg_ts"], "tokens_per_s": row["avg_ts"], "build": row.get("build_commit"),
            "cpu_info": row.get("cpu_info")}  # fmt: skip


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one_run:
        print(json.dumps(one_run(a.model, a.tokens, a.threads)))
        return
    sys.path.insert(0, str(HERE))
    from int8_quality import cpu_flags

    runs: dict[str, list[dict]] = {"pagemill": [], "llama.cpp": []}
    for i in range(a.runs):
        before = loadavg()
        r = subprocess.run([sys.executable, __file__, "--model", a.model, "--tokens", str(a.tokens), "--threads",
                            str(a.threads), "--one-run"], capture_output=True, text=True, check=True)  # fmt: skip
        runs["pagemill"].append({**json.loads(r.stdout.strip().splitlines()[-1]), "loadavg_before": before})
        before = loadavg()
        runs["llama.cpp"].append({**llama_bench(a.model, a.tokens, a.threads), "loadavg_before": before})
        print(f"run {i + 1}: pagemill {runs['pagemill'][-1]['ms_per_token']:.1f} ms/token, "
              f"llama.cpp {runs['llama.cpp'][-1]['ms_per_token']:.1f} ms/token", flush=True)  # fmt: skip
    med = {k: statistics.median(r["ms_per_token"] for r in v) for k, v in runs.items()}
    result = {"model": a.model, "tokens": a.tokens, "threads": a.threads, "runs": a.runs,
              "median_ms_per_token": med, "ratio_pagemill_over_llamacpp": med["pagemill"] / med["llama.cpp"],
              "decode_path": runs["pagemill"][0]["decode_path"], "why": runs["pagemill"][0]["why"],
              "median_breakdown_ms": {k: statistics.median(r["breakdown_ms"][k] for r in runs["pagemill"])
                                      for k in runs["pagemill"][0]["breakdown_ms"]},
              "cpu_flags": cpu_flags(), "command": " ".join(sys.argv), "per_run": runs,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    print(json.dumps({k: result[k] for k in ("median_ms_per_token", "ratio_pagemill_over_llamacpp", "decode_path",
                                             "median_breakdown_ms")}, indent=1))  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    result["loadavg_1min_end"] = loadavg()
    (OUT / "latest.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(OUT / "history.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
