"""Decode attention time per KV cache dtype at long contexts: the compiled CPU paged kernel.

    OMP_NUM_THREADS=1 python benchmarks/kv_attention_dtypes.py --json benchmarks/results/kv-attention-dtypes/kv_attention_dtypes.json

One layer's decode attention of the default model's shape (9 query heads, 3
kv heads, head_dim 64, block size 16) for a batch of sequences of one context
length, over a bf16, fp8_e4m3 and int8 pool holding the same keys/values
(bf16 queries, as the bf16 model runs). Blocks are shuffled over a pool larger
than the last-level cache, so every step streams its KV from memory as in
serving. One thread; the dtypes run interleaved, each repetition in turn, and
the table gives the median per-step CPU time (time.process_time) of --reps.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.attention.kv_dtype import quantize, quantize_int8
from pagemill.cpu_kernels.decode import decode_kernels

HEADS, KV_HEADS, D, BS = 9, 3, 64, 16


def pools(num_blocks: int, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(num_blocks, BS, KV_HEADS, D, generator=g) for _ in range(2))
    return {
        "bf16": (k.bfloat16(), v.bfloat16()),
        "fp8_e4m3": (quantize(k, torch.float8_e4m3fn), quantize(v, torch.float8_e4m3fn)),
        "int8": (quantize_int8(k), quantize_int8(v)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--tokens", type=int, default=64 * 1024, help="tokens per step (batch = tokens / context)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels = decode_kernels()
    if kernels is None:
        raise SystemExit("no compiled CPU kernels here")
    per_step_blocks = args.tokens // BS
    num_blocks = 2 * per_step_blocks + 1  # twice a step's KV: ~100 MiB of bf16, beyond the caches
    caches = pools(num_blocks)
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        batch = max(1, args.tokens // ctx)
        width = -(-ctx // BS)
        ids = list(range(1, num_blocks))
        times: dict[str, list[float]] = {name: [] for name in caches}
        q = torch.randn(batch, HEADS, D).bfloat16()
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        for rep in range(args.reps):
            random.Random(rep).shuffle(ids)
            tables = torch.tensor(ids[: batch * width], dtype=torch.int32).view(batch, width)
            for name, (k, v) in caches.items():
                t = time.process_time()
                kernels.paged_attention(q, k, v, tables, lens, D**-0.5)
                times[name].append(time.process_time() - t)
        row = {"context": ctx, "batch": batch}
        for name in caches:
            row[f"{name}_ms"] = statistics.median(times[name]) * 1e3
        rows.append(row)
    print("| context | batch | bf16 ms | fp8_e4m3 ms | int8 ms | int8 / bf16 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context']} | {r['batch']} | {r['bf16_ms']:.2f} | {r['fp8_e4m3_ms']:.2f} | {r['int8_ms']:.2f} "
              f"| {r['int8_ms'] / r['bf16_ms']:.2f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
