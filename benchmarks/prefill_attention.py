"""Prefill attention on the CPU: the query-tiled kernel against the per-token path it replaces.

    python benchmarks/prefill_attention.py --json /tmp/c64-step.json

(benchmarks/results/prefill-attention/runs.json gathers the committed runs by name.)
    python benchmarks/prefill_attention.py --model --json ...   # + one prefill step of the default model

Layer: one layer's attention over a step of prompts like the c=64 burst (--prompts
prompts of 32-256 tokens, ~2016 tokens; the default model's shape: 9 query heads,
3 kv heads, head_dim 64, block size 16, blocks scattered over the pool), fresh and
over a cached prefix (0-512 tokens each), bf16 and float32. Paths:
- tiled: DecodeKernels.prefill_attention (cpu_kernels/csrc/attention/prefill_attention.h);
- tokens: the previous dispatch, every new token a one-row query of the decode
  kernel (DecodeKernels.paged_attention over per-token tables and lengths);
- sdpa: TorchAttentionBackend without kernels (SDPA per sequence, the cached
  prefix gathered), what chunks over 1024 tokens took;
- no AMX (bf16, where the tiled kernel runs on AMX tiles here): the tiled kernel from a
  library built without them (its vdpbf16ps products), prefill_attention_amx.h's baseline.
At 1 thread the clock is time.process_time, at more perf_counter; each figure is
the median of --reps repetitions run interleaved, the order alternating (the machine
is shared: medians of interleaved runs, not means).

Model (--model): one prefill step of the default model in process (ShardDriver, as
benchmarks/decode_breakdown.py builds the runner), the same prompts, tiled vs
tokens (the kernel's method swapped between repetitions), median of --model-reps
interleaved: at 1 thread the CPU time of the step call (time.process_time), at more
the forward time the shard reports (wall).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.build import build_library
from pagemill.cpu_kernels.decode import DecodeKernels, decode_kernels

HEADS, KV_HEADS, D, BS = 9, 3, 64, 16


def prompt_lens(n: int, total: int, seed: int = 0) -> list[int]:
    """n lengths in 32..256 summing to about `total` (the c=64 burst's prefill steps)."""
    rng = random.Random(seed)
    lens = [rng.randint(32, 256) for _ in range(n)]
    f = total / sum(lens)
    return [min(256, max(32, round(x * f))) for x in lens]


class PerToken:
    """The previous path: each new token as its own query row of the decode kernel."""

    def __init__(self, kernels: DecodeKernels) -> None:
        self.kernels, self.last = kernels, None

    def __call__(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, scale, window=None):
        if self.last is None or self.last[0] is not cu_seqlens_q:  # built once per forward, as before
            n = cu_seqlens_q.diff().long()
            seq = torch.repeat_interleave(torch.arange(len(n)), n)
            offset = torch.arange(len(seq)) - cu_seqlens_q[:-1].long()[seq]
            lens = ((kv_lens.long() - n + 1)[seq] + offset).to(torch.int32)
            self.last = cu_seqlens_q, block_tables.index_select(0, seq).contiguous(), lens
        return self.kernels.paged_attention(q, k_cache, v_cache, self.last[1], self.last[2], scale, window)


def layer_case(dtype, lens: list[int], prefix: bool, seed: int = 0):
    """(q, k_new, v_new, k_cache, v_cache, meta) of one step over scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    cached = [rng.randint(0, 512) if prefix else 0 for _ in lens]
    blocks = [-(-(c + n) // BS) for c, n in zip(cached, lens)]
    num_blocks = 2 * sum(blocks) + 1
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    k_cache, v_cache = (torch.randn(num_blocks, BS, KV_HEADS, D, generator=g).to(dtype) for _ in range(2))
    tables = [[free.pop() for _ in range(b)] for b in blocks]
    slots = [t[p // BS] * BS + p % BS for t, c, n in zip(tables, cached, lens) for p in range(c, c + n)]
    meta = make_metadata(is_prefill=True, query_lens=lens, kv_lens=[c + n for c, n in zip(cached, lens)],
                         block_tables=tables, slot_mapping=slots, device="cpu")  # fmt: skip
    rows = torch.tensor(slots)
    k_new, v_new = k_cache.flatten(0, 1)[rows], v_cache.flatten(0, 1)[rows]
    q = torch.randn(sum(lens), HEADS, D, generator=g).to(dtype)
    return q, k_new, v_new, k_cache, v_cache, meta


def bench_layers(kernels: DecodeKernels, lens: list[int], threads: list[int], dtypes: list[str], reps: int,
                 no_amx: DecodeKernels | None = None) -> list:
    rows = []
    per_token, sdpa = PerToken(kernels), TorchAttentionBackend(None)
    for dtype in dtypes:
        for prefix in (False, True):
            q, k, v, kc, vc, m = layer_case(getattr(torch, dtype), lens, prefix)
            paths = {
                "tiled": lambda: kernels.prefill_attention(q, kc, vc, m.block_tables, m.cu_seqlens_q, m.context_lens,
                                                           D**-0.5),  # fmt: skip
                "tokens": lambda: per_token(q, kc, vc, m.block_tables, m.cu_seqlens_q, m.context_lens, D**-0.5),
                "sdpa": lambda: sdpa.prefill(q, k, v, kc, vc, m, D**-0.5),
            }
            if no_amx is not None and dtype == "bfloat16":
                paths["no_amx"] = lambda: no_amx.prefill_attention(q, kc, vc, m.block_tables, m.cu_seqlens_q,
                                                                   m.context_lens, D**-0.5)  # fmt: skip
            ref = paths["sdpa"]().float()
            for name, fn in paths.items():  # the same result (and warm)
                assert (fn().float() - ref).abs().max() < 0.05, name
            for n in threads:
                torch.set_num_threads(n)
                clock = time.process_time if n == 1 else time.perf_counter
                times: dict[str, list[float]] = {name: [] for name in paths}
                for rep in range(reps):
                    for name in list(paths)[:: 1 if rep % 2 else -1]:
                        t = clock()
                        paths[name]()
                        times[name].append(clock() - t)
                row = {"dtype": dtype, "prefix": prefix, "threads": n, "tokens": sum(lens),
                       "keys": sum(m.kv_lens)} | {f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}  # fmt: skip
                rows.append(row)
                more = f" {row['no_amx_ms']:.2f} | {row['no_amx_ms'] / row['tiled_ms']:.2f}x |" if "no_amx_ms" in row else \
                    (" | |" if no_amx is not None else "")
                print(f"| {dtype} | {'cached prefix' if prefix else 'fresh'} | {n} | {row['tiled_ms']:.2f} | "
                      f"{row['tokens_ms']:.2f} | {row['sdpa_ms']:.2f} | {row['tokens_ms'] / row['tiled_ms']:.2f}x |{more}",
                      flush=True)  # fmt: skip
    return rows


def bench_model(kernels: DecodeKernels, lens: list[int], dtype: str, threads: int, reps: int,
                no_amx: DecodeKernels | None = None) -> dict:
    from pagemill.bench.cli import resolve_model_dir
    from pagemill.bench.shard_driver import ShardDriver, random_prompts, warm_runner
    from pagemill.config import ShardConfig
    from pagemill.shard.model_runner import ModelRunner

    torch.set_num_threads(threads)
    runner = ModelRunner.from_shard_config(ShardConfig(model_dir=resolve_model_dir(None), uds_path="", dtype=dtype))
    warm_runner(runner, max_batch_size=len(lens), max_prefill_tokens=sum(lens) + 64, max_input=max(lens) + 8)
    driver = ShardDriver(runner)
    prompts = [p[:n] for p, n in zip(random_prompts(len(lens), max(lens), runner.config.vocab_size), lens)]
    paths = {"tiled": kernels.prefill_attention, "tokens": PerToken(kernels)}
    if no_amx is not None and dtype == "bfloat16":
        paths["no_amx"] = no_amx.prefill_attention
    times: dict[str, list[float]] = {name: [] for name in paths}
    for rep in range(reps + 1):
        for name in list(paths)[:: 1 if rep % 2 else -1]:
            kernels.prefill_attention = paths[name]  # the instance's, this process
            cpu = time.process_time()
            batch, step = driver.prefill(prompts, 2)
            cpu = time.process_time() - cpu
            for rid in batch:
                driver.release(rid)
            if rep:  # the first round warms up
                times[name].append(cpu * 1e3 if threads == 1 else step.forward_ns / 1e6)
    kernels.prefill_attention = paths["tiled"]
    return {"dtype": dtype, "threads": threads, "tokens": sum(lens)} | {
        f"{k}_ms": statistics.median(v) for k, v in times.items()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=14)
    ap.add_argument("--tokens", type=int, default=2016)
    ap.add_argument("--lens", default=None, help="prompt lengths instead (comma separated), e.g. 2048 for one long chunk")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--model", action="store_true", help="also one prefill step of the default model")
    ap.add_argument("--model-dtype", default="bfloat16")
    ap.add_argument("--model-threads", type=int, default=2)
    ap.add_argument("--model-reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kernels = decode_kernels()
    if kernels is None:
        raise SystemExit("no compiled CPU kernels here")
    lens = [int(x) for x in args.lens.split(",")] if args.lens else prompt_lens(args.prompts, args.tokens)
    print(f"prompts: {lens} ({sum(lens)} tokens); ms per layer, median of {args.reps} interleaved")
    no_amx = None
    if kernels.prefill_on_amx(D):  # the same kernel from a build without the tiles, beside it
        no_amx = DecodeKernels(build_library(("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")))
        print("AMX tiles: yes (the 'no AMX' columns: the same kernel built without them)")
    extra = (" no AMX ms | no AMX / tiled |", "---:|---:|") if no_amx else ("", "")
    print("| dtype | step | threads | tiled ms | tokens ms | sdpa ms | tokens / tiled |" + extra[0])
    print("|---|---|---:|---:|---:|---:|---:|" + extra[1])
    threads = [int(t) for t in args.threads.split(",")]
    result = {"args": vars(args), "prompt_lens": lens, "amx": no_amx is not None,
              "layer": bench_layers(kernels, lens, threads, args.dtypes.split(","), args.reps, no_amx)}  # fmt: skip
    if args.model:
        m = bench_model(kernels, lens, args.model_dtype, args.model_threads, args.model_reps, no_amx)
        result["model"] = m
        clock = "CPU ms" if m["threads"] == 1 else "forward ms (wall)"
        print(f"model prefill step ({m['dtype']}, {m['threads']} threads, {m['tokens']} tokens, {clock}, median of "
              f"{args.model_reps}): tiled {m['tiled_ms']:.0f}, tokens {m['tokens_ms']:.0f}, "
              f"saved {m['tokens_ms'] - m['tiled_ms']:.0f} ms ({1 - m['tiled_ms'] / m['tokens_ms']:.1%})"
              + (f"; tiled without AMX {m['no_amx_ms']:.0f} (the tiles save {1 - m['tiled_ms'] / m['no_amx_ms']:.1%})"
                 if "no_amx_ms" in m else ""))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
