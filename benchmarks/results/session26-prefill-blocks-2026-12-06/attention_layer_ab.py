"""Prefill attention, kernel libraries side by side, in process: one layer's attention of the
default model's shape (9 query heads, 3 kv heads, head_dim 64, bf16 pool, block size 16, blocks
scattered), each library's DecodeKernels.prefill_attention on the same inputs, the order rotating
each repetition; median wall ms of --reps. Also checks each output against float64 attention.

    LIBS=before=/path/a.so,after=/path/b.so python attention_layer_ab.py --threads 2 --reps 21 --json out.json
"""
import argparse, ctypes, json, os, pathlib, random, statistics, sys, time, torch
ROOT = pathlib.Path(__file__).resolve().parents[3]  # the repository
sys.path.insert(0, str(ROOT / "tests")); sys.path.insert(0, str(ROOT / "server"))
import test_prefill_attention as tp
from pagemill.cpu_kernels import DecodeKernels

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--reps", type=int, default=15)
ap.add_argument("--json")
a = ap.parse_args()
torch.set_num_threads(a.threads)
rng = random.Random(0)
burst = [(0, rng.randint(32, 256)) for _ in range(14)]
cases = {
    "one 2040-token prompt": [(0, 2040)],
    "14 prompts of 32-256 (c=64 burst step)": burst,
    "4 x 256 new over 512 cached": [(512, 256)] * 4,
    "8 x 255 new": [(0, 255)] * 8,
}
libs = {}
for item in os.environ["LIBS"].split(","):
    k, v = item.split("=")
    libs[k] = DecodeKernels(ctypes.CDLL(v))
tp.KV_HEADS = 3
out = {"threads": a.threads, "reps": a.reps, "libs": os.environ["LIBS"], "cases": {}}
for name, shapes in cases.items():
    tp.NUM_BLOCKS = sum(-(-(c + n) // 16) for c, n in shapes) + 8
    step = tp.Step(shapes, 3, 64, torch.bfloat16, seed=1)
    m = step.meta
    run = lambda lab: libs[lab].prefill_attention(step.q, step.k_cache, step.v_cache, m.block_tables, m.cu_seqlens_q, m.context_lens, 0.125, None)
    exp = step.expected(0.125, None)
    errs = {}
    for lab in libs:
        d = (run(lab).double() - exp).abs()
        errs[lab] = (float(d.max()), float(d.mean()))
    t = {lab: [] for lab in libs}
    order = list(libs)
    for i in range(a.reps):
        for lab in order[i % len(order):] + order[: i % len(order)]:
            s = time.perf_counter(); run(lab); t[lab].append((time.perf_counter() - s) * 1e3)
    med = {lab: statistics.median(v) for lab, v in t.items()}
    base = order[0]
    print(f"{name:42s} " + "  ".join(f"{lab} {med[lab]:7.2f} ms ({med[lab]/med[base]:.3f}x, err max {errs[lab][0]:.1e} mean {errs[lab][1]:.1e})" for lab in order), flush=True)
    out["cases"][name] = {"shapes": shapes, "median_ms": med, "runs_ms": t, "error_vs_float64": errs}
if a.json:
    json.dump(out, open(a.json, "w"), indent=1)
