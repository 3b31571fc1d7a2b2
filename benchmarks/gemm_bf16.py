"""The bf16 linears of the default model: cpu_kernels/csrc/gemm/gemm_bf16.h against oneDNN's packed
inner product (what PackedLinear ran before) and F.linear, at decode and prefill row counts.

    python benchmarks/gemm_bf16.py --threads 2 --rows 1,8,16,32,64,256,2048 \
        --json /tmp/hot.json   (benchmarks/results/gemm-bf16/runs.json gathers the committed runs by name)
    python benchmarks/gemm_bf16.py --threads 2 --rows 8,16,64 --cold --json .../cold.json

Hot: one weight, called again and again (it stays in cache: the multiply's own rate).
--cold: a ring of copies of the weights larger than the last-level cache, so every call streams
its weight from memory as a decode step does. Each repetition times the paths back to back
(interleaved), and the table gives medians; GFLOP/s is 2*M*N*K / time.
On a CPU with AMX-BF16 the kernel runs on its tiles from 4 rows (gemm_amx.h); a second column,
"no AMX", times the same kernel from a library built without them (its vdpbf16ps tiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.cpu_kernels.build import build_library
from pagemill.cpu_kernels.gemm import GemmBf16Kernel, gemm_bf16_kernel, pack_bf16

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}  # fmt: skip


def measure(rows: int, name: str, cold: bool, reps: int, no_amx: GemmBf16Kernel | None) -> dict:
    n, k = SHAPES[name]
    copies = max(1, (96 << 20) // (n * k * 2)) if cold else 1  # 96 MiB: over a 32 MiB L3
    w = torch.randn(copies, n, k).bfloat16()
    kernel = gemm_bf16_kernel()
    packed = torch.stack([pack_bf16(w[i]) for i in range(copies)])
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w[i], 16) for i in range(copies)]
    x = torch.randn(rows, k).bfloat16()
    paths = {
        "kernel": lambda i: kernel(x, packed[i], None, n),
        "onednn": lambda i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "F.linear": lambda i: torch.nn.functional.linear(x, w[i]),
    }
    if no_amx is not None:
        paths["no AMX"] = lambda i: no_amx(x, packed[i], None, n)
    calls = max(1, min(200, int(2e9 / (2 * rows * n * k))))
    times: dict[str, list[float]] = {p: [] for p in paths}
    for p, fn in paths.items():
        fn(0)  # warm
    for _ in range(reps):
        for p, fn in paths.items():
            t = time.perf_counter()
            for c in range(calls):
                fn(c % copies)
            times[p].append((time.perf_counter() - t) / calls)
    med = {p: statistics.median(v) for p, v in times.items()}
    return {"rows": rows, "linear": name, "n": n, "k": k, "cold": cold,
            "ms": {p: v * 1e3 for p, v in med.items()},
            "gflops": {p: 2 * rows * n * k / v / 1e9 for p, v in med.items()}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,16,32,64,256,2048")
    ap.add_argument("--linears", default=",".join(SHAPES))
    ap.add_argument("--cold", action="store_true", help="stream the weights from memory (a ring over the LLC)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kernel = gemm_bf16_kernel()
    if kernel is None or not kernel.fast:
        raise SystemExit("the bf16 gemm kernel has no AVX512-BF16 path on this machine")
    no_amx = GemmBf16Kernel(build_library(("-mno-amx-tile", "-mno-amx-bf16"))) if kernel.amx else None
    results = []
    print(f"{a.threads} threads, {'cold (weights from memory)' if a.cold else 'hot (weights in cache)'}, "
          f"AMX tiles: {'yes' if kernel.amx else 'no'}")
    extra = " no AMX ms | no AMX / kernel |" if no_amx else ""
    print(f"| rows | linear | kernel ms | oneDNN packed ms | F.linear ms | kernel GFLOP/s | oneDNN / kernel |{extra}")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if no_amx else ""))
    for rows in map(int, a.rows.split(",")):
        for name in a.linears.split(","):
            if name == "head" and rows > 256:
                continue
            r = measure(rows, name, a.cold, a.reps, no_amx)
            results.append(r)
            ms = r["ms"]
            more = f" {ms['no AMX']:.3f} | {ms['no AMX'] / ms['kernel']:.2f} |" if no_amx else ""
            print(f"| {rows} | {name} | {ms['kernel']:.3f} | {ms['onednn']:.3f} | {ms['F.linear']:.3f} | "
                  f"{r['gflops']['kernel']:.0f} | {ms['onednn'] / ms['kernel']:.2f} |{more}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "cold": a.cold, "amx": kernel.amx, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
