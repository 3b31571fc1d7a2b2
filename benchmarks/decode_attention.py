"""One layer's decode attention through the compiled CPU paged kernel, against the memory floor.

    OMP_NUM_THREADS=1 python benchmarks/decode_attention.py --baseline /tmp/base.so \
        --json /tmp/decode_attention.json   (benchmarks/results/decode-attention/runs.json gathers the committed runs by name)

The default model's shape (9 query heads, 3 kv heads, head_dim 64, --block-size
64 as the shard's CPU default), bf16 queries over a bf16 pool (and --dtypes float32,fp8_e4m3,int8), for
the batches that matter: 64 x 192 tokens (the c=64 benchmark), 24 x 512 and
batch 1 x 200. The pool is --pool-mib per cache, in 2 MiB pages as the shard
holds it (models/huge_pages.py; --no-huge-pages: 4 KiB), its blocks drawn
anew each repetition and for each kernel (--layout scattered: at random over
the pool; adjacent: one run of adjacent ids per sequence, the runs at random),
so a step streams its KV from memory as a serving step does (30 layers' KV
never fit the caches). Per-step CPU time (time.process_time) on one thread,
wall time with --threads above 1 (--clock); median of --reps; the kernels (this tree's
and, with --baseline, other builds of the library: .so paths, comma separated)
run interleaved, in alternating order. GB/s: the KV bytes one step must read
(K and V rows of all kv heads, scales included) over its median time, beside
the machine's own streaming rate, a 1 GiB float32 sum in the same process, and
beside "gather": torch.index_select copying the same number of blocks of K
and V (the reads alone, no arithmetic).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import time

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.attention.kv_dtype import quantize, quantize_int8
from pagemill.cpu_kernels.decode import DecodeKernels, decode_kernels
from pagemill.models.huge_pages import huge_zeros

HEADS, KV_HEADS, D = 9, 3, 64


def pool(dtype: str, num_blocks: int, bs: int, seed: int, huge: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(num_blocks, bs, KV_HEADS, D, generator=g) for _ in range(2))
    if dtype == "int8":
        k, v = quantize_int8(k), quantize_int8(v)
    elif dtype.startswith("fp8"):
        k, v = quantize(k, torch.float8_e4m3fn), quantize(v, torch.float8_e4m3fn)
    else:
        k, v = k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))
    if not huge:
        return k, v
    # As the shard holds its pool (models/huge_pages.py): 2 MiB pages.
    return tuple(huge_zeros(tuple(x.shape), x.dtype).copy_(x) for x in (k, v))


def block_ids(rng: random.Random, ids: list[int], batch: int, width: int, layout: str) -> torch.Tensor:
    """Each sequence's block table: blocks drawn at random over the pool ("scattered"), or a
    run of adjacent ids per sequence, the runs at random places ("adjacent")."""
    rng.shuffle(ids)
    if layout == "scattered":
        return torch.tensor(ids[: batch * width], dtype=torch.int32).view(batch, width)
    runs = len(ids) // width  # the pool cut into runs of `width` blocks, `batch` of them drawn
    starts = rng.sample(range(runs), batch)
    return torch.tensor([[s * width + i for i in range(width)] for s in starts], dtype=torch.int32)


def stream_gbs(reps: int = 5) -> float:
    """The machine's streaming read rate on this thread: a 1 GiB float32 sum, median of reps."""
    x = torch.ones(1 << 28)
    times = []
    for _ in range(reps):
        t = time.process_time()
        x.sum()
        times.append(time.process_time() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="64x192,24x512,1x200", help="batch x context, comma separated")
    ap.add_argument("--dtypes", default="bfloat16", help="cache dtypes: bfloat16,float32,fp8_e4m3,int8")
    ap.add_argument("--baseline", default=None,
                    help="other builds of the kernel library (.so, comma separated) to run beside")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per KV block (the shard's CPU default: 64)")
    ap.add_argument("--pool-mib", type=int, default=128)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="kernel threads")
    ap.add_argument("--clock", default="auto", choices=["auto", "cpu", "wall"],
                    help="CPU time of all threads or wall time; auto: CPU on one thread, else wall")
    ap.add_argument("--layout", default="scattered", choices=["scattered", "adjacent"],
                    help="each sequence's blocks at random, or in one run of adjacent ids")
    ap.add_argument("--no-huge-pages", action="store_true", help="the pool in ordinary 4 KiB pages")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    wall = args.clock == "wall" or (args.clock == "auto" and args.threads > 1)
    clock = time.perf_counter if wall else time.process_time
    kernels = {"this": decode_kernels()}
    if kernels["this"] is None:
        raise SystemExit("no compiled CPU kernels here")
    for i, path in enumerate(args.baseline.split(",") if args.baseline else []):
        kernels["baseline" if i == 0 else f"other{i}"] = DecodeKernels(ctypes.CDLL(path))
    gbs = stream_gbs()
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtypes.split(","):
        qdtype = torch.float32 if dtype == "float32" else torch.bfloat16
        row_bytes = D * (1 if dtype in ("int8", "fp8_e4m3") else torch.finfo(getattr(torch, dtype)).bits // 8)
        row_bytes += 4 if dtype == "int8" else 0
        num_blocks = args.pool_mib * 2**20 // (args.block_size * KV_HEADS * row_bytes)
        k, v = pool(dtype, num_blocks, args.block_size, 0, not args.no_huge_pages)
        for case in args.cases.split(","):
            batch, ctx = map(int, case.split("x"))
            width = -(-ctx // args.block_size)
            q = torch.randn(batch, HEADS, D).to(qdtype)
            lens = torch.full((batch,), ctx, dtype=torch.int32)
            times: dict[str, list[float]] = {name: [] for name in [*kernels, "gather"]}
            ids = list(range(1, num_blocks))
            copy = torch.empty((batch * width, *k.shape[1:]), dtype=k.dtype)
            for rep in range(args.reps):
                # Each kernel its own blocks (the step before left its blocks in the caches), in
                # alternating order.
                for i, (name, kern) in enumerate(list(kernels.items())[:: 1 if rep % 2 else -1]):
                    tables = block_ids(random.Random(rep * 16 + i), ids, batch, width, args.layout)
                    t = clock()
                    kern.paged_attention(q, k, v, tables, lens, D**-0.5)
                    times[name].append(clock() - t)
                # The same reads without the arithmetic: torch copying the step's K and V blocks out.
                blocks = block_ids(random.Random(rep * 16 + 15), ids, batch, width, args.layout).view(-1).long()
                t = clock()
                torch.index_select(k, 0, blocks, out=copy[: len(blocks)])
                torch.index_select(v, 0, blocks, out=copy[: len(blocks)])
                times["gather"].append(clock() - t)
            kv_bytes = 2 * batch * ctx * KV_HEADS * row_bytes
            row = {"dtype": dtype, "batch": batch, "context": ctx, "kv_mb": kv_bytes / 1e6}
            for name in times:
                ms = statistics.median(times[name]) * 1e3
                row[f"{name}_ms"] = ms
                row[f"{name}_gbs"] = kv_bytes / ms / 1e6
            rows.append(row)
    names = [*kernels, "gather"]
    print(f"streaming read (1 GiB float32 sum, 1 thread): {gbs:.1f} GB/s; {args.threads} kernel thread(s), "
          f"{args.layout} blocks of {args.block_size}, {'4 KiB' if args.no_huge_pages else '2 MiB'} pages, {'wall' if wall else 'CPU'} time")
    print("| cache | batch x context | KV MB | " + " | ".join(f"{n} ms | {n} GB/s" for n in names)
          + (" | speedup |" if args.baseline else " |"))  # fmt: skip
    print("|---|---|---:|" + "---:|---:|" * len(names) + ("---:|" if args.baseline else ""))
    for r in rows:
        cells = " | ".join(f"{r[f'{n}_ms']:.3f} | {r[f'{n}_gbs']:.1f}" for n in names)
        speed = f" | {r['baseline_ms'] / r['this_ms']:.2f}x" if args.baseline else ""
        print(f"| {r['dtype']} | {r['batch']} x {r['context']} | {r['kv_mb']:.1f} | {cells}{speed} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "stream_gbs": gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
