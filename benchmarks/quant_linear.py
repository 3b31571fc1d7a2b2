"""The GGUF quant linears (cpu_kernels/quant.py) at the shapes of Gemma 3 270M and Llama-3.2-1B,
against torch's F.linear on the dequantized weights in float32 and bfloat16.

    python benchmarks/quant_linear.py [--threads 2] [--types Q8_0,Q4_K] [--rows 1,64,512] [--reps 5]
        [--quick] [--json benchmarks/results/quant-linear/latest.json]

- M = 1 (decode): GB/s of weight streamed, and that rate as a fraction of a plain read of memory
  (read_rate.plain_read, over 256 MiB). Each call reads its weight from memory: the calls walk a
  ring of copies larger than the last-level cache, as a decode step walks its layers.
- M = 64 and 512 (batched decode, prefill chunks): GFLOP/s (2 M N K / time) of one weight,
  and the ratio to torch's float32 and bfloat16 F.linear at the same shape.
Each repetition times every path back to back (interleaved, so machine noise hits them alike);
the table gives medians (at least 2 repetitions; a cell stops adding them after 90 s). --quick
leaves out the output heads at 512 rows (the slowest cells).
K-quants need K % 256 == 0: Gemma's 640-wide inputs are "-" for them (its GGUF uses Q5_0/Q8_0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pagemill.cpu_kernels.quant import GGML_TYPES, QuantKernel, quant_kernel
from pagemill.cpu_kernels.read_rate import plain_read

# (model, linear, N = out_features, K = in_features)
SHAPES = [
    ("gemma3-270m", "q", 1024, 640), ("gemma3-270m", "k/v", 256, 640), ("gemma3-270m", "o", 640, 1024),
    ("gemma3-270m", "gate/up", 2048, 640), ("gemma3-270m", "down", 640, 2048),
    ("gemma3-270m", "head", 262144, 640),
    ("llama3.2-1b", "q/o", 2048, 2048), ("llama3.2-1b", "k/v", 512, 2048), ("llama3.2-1b", "gate/up", 8192, 2048),
    ("llama3.2-1b", "down", 2048, 8192), ("llama3.2-1b", "head", 128256, 2048),
]  # fmt: skip
QUANT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
BY_NAME = {t.name: i for i, t in GGML_TYPES.items()}
RING_BYTES = 96 << 20  # over a 32 MiB L3: every M = 1 call streams from memory


def random_weight(qtype: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """GGUF rows of random quants with small finite f16 scales (the values do not change the speed)."""
    t = GGML_TYPES[qtype]
    nb = k // t.block_elems
    b = rng.integers(0, 256, size=(n, nb, t.block_bytes), dtype=np.uint8)
    d = (rng.standard_normal((n, nb)) * 0.01).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    if t.name == "Q6_K":
        b[..., 208:210] = d
    else:
        b[..., 0:2] = d
        if t.name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            b[..., 2:4] = d
    return torch.from_numpy(b.reshape(n, -1))


def timed(paths: dict, reps: int, calls: int, budget_s: float = 90.0) -> dict[str, float]:
    """Median seconds per call of each path; path(i) makes call i (i picks a copy of the weight).
    Past budget_s, a cell stops after 2 repetitions (torch's bf16 GEMM at 512 rows of an output
    head takes a minute a call on CPUs without AVX512-BF16)."""
    times: dict[str, list[float]] = {p: [] for p in paths}
    for fn in paths.values():
        fn(0)  # warm: first-touch pages, build-once state
    start = time.perf_counter()
    for rep in range(reps):
        for p, fn in paths.items():
            t = time.perf_counter()
            for i in range(calls):
                fn(i)
            times[p].append((time.perf_counter() - t) / calls)
        if rep >= 1 and time.perf_counter() - start > budget_s:
            break
    return {p: statistics.median(v) for p, v in times.items()}


def shape_paths(kernel: QuantKernel, n: int, k: int, rows: int, types: list[str], rng) -> tuple[dict, dict]:
    """The paths at one shape and row count, and each one's weight bytes."""
    per_copy = n * k * 4
    copies = max(1, RING_BYTES // per_copy) if rows == 1 else 1
    wf = [torch.randn(n, k) * 0.02 for _ in range(copies)]
    wb = [w.bfloat16() for w in wf]
    x = torch.randn(rows, k)
    xb = x.bfloat16()
    paths = {"torch f32": lambda i: F.linear(x, wf[i % copies]), "torch bf16": lambda i: F.linear(xb, wb[i % copies])}
    nbytes = {"torch f32": n * k * 4, "torch bf16": n * k * 2}
    for name in types:
        qtype = BY_NAME[name]
        if k % GGML_TYPES[qtype].block_elems:
            continue
        raw = random_weight(qtype, n, k, rng)
        qc = max(1, RING_BYTES // raw.numel()) if rows == 1 else 1
        ws = [kernel.prepare(raw, qtype, k) for _ in range(qc)]

        def path(i, ws=ws, qc=qc):
            return kernel.linear(x, ws[i % qc])

        paths[name] = path
        nbytes[name] = raw.numel()
    return paths, nbytes


def run_shape(kernel, model, linear, n, k, rows, types, reps, read_gbs, rng) -> list[dict]:
    paths, nbytes = shape_paths(kernel, n, k, rows, types, rng)
    flop = 2 * rows * n * k
    calls = max(1, min(100, int(0.05 / max(1e-6, flop / 100e9))))  # ~50 ms of work per timing
    med = timed(paths, reps, calls)
    out = []
    for p, s in med.items():
        r = {"model": model, "linear": linear, "n": n, "k": k, "rows": rows, "path": p, "ms": s * 1e3,
             "gflops": flop / s / 1e9, "weight_gbs": nbytes[p] / s / 1e9}  # fmt: skip
        if rows == 1 and read_gbs:
            r["read_fraction"] = r["weight_gbs"] / read_gbs
        r["vs_torch_f32"] = med["torch f32"] / s
        r["vs_torch_bf16"] = med["torch bf16"] / s
        out.append(r)
    return out


def read_rate(reps: int = 7) -> float | None:
    fn = plain_read()
    if fn is None:
        return None
    buf = torch.ones(64 << 20)  # 256 MiB
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(buf)
        times.append(time.perf_counter() - t)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def cpu_info(kernel: QuantKernel) -> dict:
    model, flags = platform.processor(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                break
    except OSError:
        pass
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
              "amx_int8"]  # fmt: skip
    path = {2: "VNNI (vpdpbusd)", 1: "AVX2 (vpmaddubsw)", 0: "portable"}[kernel.simd]
    # A busy machine and libgomp's spinning waits make the 2-thread cells slower than 1 thread
    # (a plain read included); the load and the wait policy say how to read them.
    return {"model": model, "flags": [f for f in wanted if f in flags], "kernel_path": path,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"), "load_average": os.getloadavg()}  # fmt: skip


def table(results: list[dict], rows: list[int]) -> str:
    """One line per (shape, path): M = 1 GB/s (fraction of a plain read), then GFLOP/s and the
    ratios to torch f32 / bf16 at the larger row counts."""
    head = f"{'shape':<26}{'path':<11}"
    for m in rows:
        head += f"{'M=1 GB/s (read)':>20}" if m == 1 else f"{f'M={m} GF/s (x f32, x bf16)':>30}"
    lines = [head]
    keys = sorted({(r["model"], r["linear"], r["n"], r["k"]) for r in results}, key=lambda s: [x[:4] for x in SHAPES].index(s))
    for model, linear, n, k in keys:
        cell = {(r["path"], r["rows"]): r for r in results if (r["model"], r["linear"]) == (model, linear)}
        for path in ["torch f32", "torch bf16"] + QUANT_TYPES:
            if not any((path, m) in cell for m in rows):
                continue
            line = f"{f'{model} {linear} {k}->{n}':<26}{path:<11}"
            for m in rows:
                r = cell.get((path, m))
                if r is None:
                    line += f"{'-':>20}" if m == 1 else f"{'-':>30}"
                elif m == 1:
                    frac = f" ({r['read_fraction']:.2f})" if "read_fraction" in r else ""
                    line += f"{r['weight_gbs']:>14.1f}{frac:>6}"
                else:
                    line += f"{r['gflops']:>14.1f} (x{r['vs_torch_f32']:4.2f}, x{r['vs_torch_bf16']:4.2f})"
            lines.append(line)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--types", default=",".join(QUANT_TYPES))
    ap.add_argument("--rows", default="1,64,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="leave out the output heads at 512 rows")
    ap.add_argument("--models", default="gemma3-270m,llama3.2-1b")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "quant-linear" / "latest.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = quant_kernel()
    if kernel is None:
        raise SystemExit("the CPU kernel library is unavailable (no compiler?)")
    types, rows = args.types.split(","), [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    read_gbs = read_rate()
    info = cpu_info(kernel)
    print(f"{info['model']}; flags {' '.join(info['flags'])}; kernels: {info['kernel_path']}; "
          f"{info['torch_threads']} threads; plain read {read_gbs or 0:.1f} GB/s; OMP_WAIT_POLICY "
          f"{info['omp_wait_policy']}; load average {info['load_average'][0]:.1f}", flush=True)  # fmt: skip
    results = []
    for model, linear, n, k in SHAPES:
        if model not in args.models.split(","):
            continue
        for m in rows:
            if args.quick and linear == "head" and m > 64:
                continue
            t = time.perf_counter()
            results += run_shape(kernel, model, linear, n, k, m, types, args.reps, read_gbs, rng)
            print(f"  {model} {linear} M={m}: {time.perf_counter() - t:.1f} s", flush=True)
    print(table(results, rows))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": info, "plain_read_gbs": read_gbs, "reps": args.reps, "rows": rows,
                               "results": results}, indent=1) + "\n")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
