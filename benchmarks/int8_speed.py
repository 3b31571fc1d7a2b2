"""Speed of `--quantize int8` against float32 and bfloat16, interleaved in one process.

    python benchmarks/int8_speed.py [--batch-sizes 1 4 16 64] [--steps 15] [--json out.json]
    python benchmarks/int8_speed.py --fused-ab [--batch-sizes 1 2 4] [--threads 1 2] [--steps 40]

Two measurements, the variants alternating round by round so machine noise hits them alike:

1. linears alone, the default model's shapes (30 layers of qkv, o, gate_up, down + the output
   head) at 1 and 64 rows: the int8 kernel against oneDNN's packed float32 inner product (what
   the float32 module path uses), torch's bfloat16 F.linear (oneDNN's bf16 GEMM on AVX512-BF16)
   and, at 1 row, the compiled float32 matvec.
2. decode steps of the default model through ModelRunner (forward_ns as the shard reports it:
   forward + sampling) at each batch size, 64 prompt tokens: float32 (default: the fused layer
   up to 5 sequences), float32 module path (fused layer off), bfloat16, int8 with the rest in
   float32, int8 with the rest in bfloat16.

With --fused-ab, instead: decode steps at batches 1, 2, 4 (--batch-sizes) with 1 and 2 threads
(--threads) of int8 through the fused whole-layer decode (models/fused_decode.py), the same
int8 model through the module path (fused layer off), and bf16 through its fused layer; the rest
in bfloat16 (the server's `--dtype bfloat16 --quantize int8`), medians of interleaved steps.

Also prints, at batch 1, the int8 step minus its linears (time the step spends outside the
linears: norms, rotary, attention, residuals, Python dispatch, sampling): what an int8 fused
layer could remove. Medians and minima; on a shared machine compare ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import _repo  # noqa: E402,F401  (the repository from this file's path)

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def _stats(v: list[float]) -> dict:
    return {"median_ms": statistics.median(v), "min_ms": min(v)}


def linears(rows: int, rounds: int) -> dict:
    from pagemill.cpu_kernels.matvec import matvec_kernel
    from pagemill.cpu_kernels.int8 import int8_kernel
    from pagemill.models.quantized_linear import QuantizedLinear

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) * 0.05 for _ in range(LAYERS) for n, k in SHAPES]
    ws.append(torch.randn(VOCAB, HIDDEN, generator=g) * 0.05)
    kernel, matvec = int8_kernel(), matvec_kernel()
    q = [QuantizedLinear(w, None, kernel) for w in ws]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
    bf = [w.bfloat16() for w in ws]
    xs = {k: torch.randn(rows, k, generator=g) for k in (576, 1536)}
    xb = {k: x.bfloat16() for k, x in xs.items()}
    variants = {
        "int8": lambda: [m(xs[m.in_features]) for m in q],
        "int8 (bf16 rows)": lambda: [m(xb[m.in_features]) for m in q],
        "onednn fp32 packed": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                       for w, p in zip(ws, packed)],
        "bf16 F.linear": lambda: [F.linear(xb[w.shape[1]], w) for w in bf],
    }  # fmt: skip
    if rows <= matvec.max_rows:
        variants["fp32 matvec"] = lambda: [matvec(xs[w.shape[1]], w, None) for w in ws]
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    macs = sum(w.numel() for w in ws) * rows
    out = {k: {**_stats(v), "gmac_s": macs / statistics.median(v) / 1e6} for k, v in times.items()}
    out["int8"]["weight_mb"] = sum(m.qweight.numel() for m in q) / 1e6
    return out


def decode(batch_sizes: list[int], steps: int) -> dict:
    from pagemill.bench.cli import resolve_model_dir
    from pagemill.bench.shard_driver import ShardDriver, random_prompts, warm_runner
    from pagemill.config import ShardConfig
    from pagemill.shard.model_runner import ModelRunner

    model_dir = resolve_model_dir(None)
    configs = {"fp32": ("float32", None), "fp32 module": ("float32", None), "bf16": ("bfloat16", None),
               "int8 (fp32 rest)": ("float32", "int8"), "int8 (bf16 rest)": ("bfloat16", "int8")}  # fmt: skip
    bmax = max(batch_sizes)
    runners = {}
    for name, (dtype, quantize) in configs.items():
        cfg = ShardConfig(model_dir=model_dir, uds_path="", dtype=dtype, quantize=quantize, kv_cache_memory=1 << 30)
        r = ModelRunner.from_shard_config(cfg)
        warm_runner(r, max_batch_size=bmax, max_prefill_tokens=bmax * 64, max_input=64 + steps + 2)
        if name == "fp32 module":
            r.model.model.fused = None
        runners[name] = r
    out = {}
    for b in batch_sizes:
        drivers, batches = {}, {}
        for name, r in runners.items():
            d = drivers[name] = ShardDriver(r)
            batches[name], _ = d.prefill(random_prompts(b, 64, r.config.vocab_size), max_new_tokens=steps + 2)
        times: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(steps):
            for name in runners:
                times[name].append(drivers[name].decode(batches[name]).forward_ns / 1e6)
        for name, d in drivers.items():
            for rid in list(d.lens):
                d.release(rid)
        out[b] = {k: _stats(v) for k, v in times.items()}
        print(f"batch {b:3d}: " + ", ".join(f"{k} {v['median_ms']:.1f}" for k, v in out[b].items()) + " ms",
              flush=True)  # fmt: skip
    return out


def fused_ab(batch_sizes: list[int], threads: list[int], steps: int) -> dict:
    """{threads: {batch: {variant: stats}}}: int8 fused vs int8 module path vs bf16 fused."""
    from pagemill.bench.cli import resolve_model_dir
    from pagemill.bench.shard_driver import ShardDriver, random_prompts, warm_runner
    from pagemill.config import ShardConfig
    from pagemill.shard.model_runner import ModelRunner

    model_dir = resolve_model_dir(None)
    configs = {"int8 fused": "int8", "int8 module": "int8", "bf16 fused": None}
    runners = {}
    for name, quantize in configs.items():
        cfg = ShardConfig(model_dir=model_dir, uds_path="", dtype="bfloat16", quantize=quantize,
                          kv_cache_memory=1 << 30)  # fmt: skip
        r = runners[name] = ModelRunner.from_shard_config(cfg)
        warm_runner(r, max_batch_size=max(batch_sizes), max_prefill_tokens=max(batch_sizes) * 64,
                    max_input=64 + steps + 2)  # fmt: skip
        fused = r.model.model.fused
        assert fused is not None and fused.int8 == (quantize == "int8"), f"{name}: unexpected fused decoder"
        if name == "int8 module":
            r.model.model.fused = None
    out: dict = {}
    for t in threads:
        torch.set_num_threads(t)
        out[t] = {}
        for b in batch_sizes:
            drivers, batches = {}, {}
            for name, r in runners.items():
                d = drivers[name] = ShardDriver(r)
                batches[name], _ = d.prefill(random_prompts(b, 64, r.config.vocab_size), max_new_tokens=steps + 2)
            times: dict[str, list[float]] = {k: [] for k in runners}
            for _ in range(steps):
                for name in runners:
                    times[name].append(drivers[name].decode(batches[name]).forward_ns / 1e6)
            for d in drivers.values():
                for rid in list(d.lens):
                    d.release(rid)
            out[t][b] = {k: _stats(v) for k, v in times.items()}
            print(f"{t} thread(s), batch {b}: " + ", ".join(f"{k} {v['median_ms']:.1f}" for k, v in out[t][b].items())
                  + " ms", flush=True)  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", default=None, help="default: benchmarks/results/int8-speed/int8_speed.json (--fused-ab: int8_fused_decode.json)")
    p.add_argument("--fused-ab", action="store_true", help="int8 fused vs module path vs bf16 fused decode steps")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    a = p.parse_args()
    from int8_quality import cpu_flags

    res: dict = {"threads": torch.get_num_threads(), "cpu_flags": cpu_flags()}
    if a.fused_ab:
        with torch.inference_mode():
            res["decode_step_ms"] = fused_ab(a.batch_sizes, a.threads, a.steps)
        print("\n| threads | batch | " + " | ".join(next(iter(next(iter(res["decode_step_ms"].values())).values())))
              + " |\n| ---: | ---: | ---: | ---: | ---: |")  # fmt: skip
        for t, rows in res["decode_step_ms"].items():
            for b, row in rows.items():
                print(f"| {t} | {b} | " + " | ".join(f"{v['median_ms']:.1f}" for v in row.values()) + " |")
        _write(res, a.json or _repo.results("int8-speed", "int8_fused_decode.json"))
        return
    with torch.inference_mode():
        res["linears"] = {}
        for rows in (1, 64):
            lin = res["linears"][rows] = linears(rows, a.rounds)
            print(f"linears, {rows} row(s): " + ", ".join(f"{k} {v['median_ms']:.1f} ms" for k, v in lin.items()),
                  flush=True)  # fmt: skip
        res["decode"] = decode(a.batch_sizes, a.steps)
    print()
    names = list(next(iter(res["decode"].values())))
    print("| batch | " + " | ".join(names) + " |")
    print("| ---: |" + " ---: |" * len(names))
    for b, row in res["decode"].items():
        print(f"| {b} | " + " | ".join(f"{row[n]['median_ms']:.1f}" for n in names) + " |")
    if 1 in res["decode"]:
        step = res["decode"][1]["int8 (fp32 rest)"]["median_ms"]
        lin = res["linears"][1]["int8"]["median_ms"]
        res["int8_batch1_outside_linears_ms"] = step - lin
        print(f"\nbatch 1, int8: step {step:.1f} ms, its linears alone {lin:.1f} ms -> {step - lin:.1f} ms outside "
              "the linears (what a fused int8 layer would address)")  # fmt: skip
    _write(res, a.json or _repo.results("int8-speed", "int8_speed.json"))


def _write(res: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
