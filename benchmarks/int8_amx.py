"""The int8 linear (--quantize int8) on AMX-INT8 tiles against the same kernel built without them
(its AVX512-VNNI tiles), at the default model's shapes: decode row counts and a prefill.

    python benchmarks/int8_amx.py --threads 2 --json benchmarks/results/int8-amx/int8.json

Both give the same bits (tests/test_int8_linear.py); this is their speed. bf16 rows in, as the
model feeds them, activations quantized inside each call (included). Weights stay in cache
between calls (hot). Each repetition times the two back to back; medians of --reps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.cpu_kernels.build import build_library
from pagemill.cpu_kernels.int8 import Int8LinearKernel, int8_kernel
from pagemill.models.quantized_linear import QuantizedLinear

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="4,5,8,16,64,2048")
    ap.add_argument("--linears", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    amx = int8_kernel()
    if amx is None or not amx.amx:
        raise SystemExit("no AMX-INT8 path here (CPU without amx_int8, or the OS refused the tiles)")
    vnni = Int8LinearKernel(build_library(("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")))
    results = []
    print(f"{a.threads} threads, hot")
    print("| rows | linear | AMX ms | VNNI ms | AMX GOP/s | VNNI / AMX |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for rows in map(int, a.rows.split(",")):
        for name in a.linears.split(","):
            if name == "head" and rows > 256:
                continue
            n, k = SHAPES[name]
            lin = QuantizedLinear(torch.randn(n, k), None, amx)
            x = torch.randn(rows, k).bfloat16()
            paths = {p: (lambda kern=kern: kern(x, lin.qweight, lin.w_scale, lin.w_corr, None, n, 0))
                     for p, kern in (("amx", amx), ("vnni", vnni))}  # fmt: skip
            calls = max(3, min(300, int(1e9 / (2 * rows * n * k))))
            times: dict[str, list[float]] = {p: [] for p in paths}
            for _ in range(a.reps):
                for p, fn in paths.items():
                    t = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    times[p].append((time.perf_counter() - t) / calls)
            ms = {p: statistics.median(v) * 1e3 for p, v in times.items()}
            gops = 2 * rows * n * k / ms["amx"] / 1e6
            results.append({"rows": rows, "linear": name, "n": n, "k": k, "ms": ms, "gops_amx": gops})
            ratio = ms["vnni"] / ms["amx"]
            print(f"| {rows} | {name} | {ms['amx']:.3f} | {ms['vnni']:.3f} | {gops:.0f} | {ratio:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
