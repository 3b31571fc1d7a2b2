"""The compiled pieces of a batched bf16 decode step against the torch paths they replace.

    python benchmarks/decode_kernels.py --batch 64 --rounds 15 --json benchmarks/results/decode-kernels/decode_kernels_b64.json

At 64 running sequences of the default model's shapes (9 query / 3 KV heads
of 64, 576 hidden, 49152 vocabulary), one layer's worth of each:

- paged attention: cpu_kernels/csrc/attention/paged_attention.h through the torch backend,
  against the backend's torch path (gather the blocks, SDPA), contexts drawn
  uniformly from 1..480 tokens (mean ~240) in shuffled blocks of 16;
- greedy sampling: cpu_kernels/csrc/rowwise/greedy.cpp against Sampler's torch path on
  bf16 logits;
- RMSNorm: cpu_kernels/csrc/rowwise/norm.cpp against the torch casts;
- residual add + RMSNorm: norm.cpp's add_and_norm against torch's bf16 add
  followed by the norm kernel (what the module path ran before);
- KV write: cpu_kernels/csrc/attention/kv_write.cpp against the backend's two index_copy_,
  into a pool of 4096 shuffled blocks of 16.

CPU time (time.process_time) of one thread, variants interleaved within each
round, medians: what each costs a core, not affected by how busy the other
core is. A step multiplies attention, norms and KV writes by the layer count
(30, and 2 norms per layer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.decode import decode_kernels
from pagemill.cpu_kernels.rowwise import greedy_kernel, norm_kernel
from pagemill.models.layers import RMSNorm
from pagemill.sampling import Sampler, SamplingParams


class Row:
    def __init__(self) -> None:
        self.params, self.generator, self.penalties, self.top_n = SamplingParams(), None, None, 0


def cpu_ms(fns: dict, rounds: int) -> dict:
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.process_time()
            fn()
            times[name].append(time.process_time() - t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def attention_case(batch: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    lens = torch.randint(1, 481, (batch,), generator=g).tolist()
    need = [-(-n // bs) for n in lens]
    perm = (torch.randperm(sum(need) + 1, generator=g) + 1).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in need]
    k, v = (torch.randn(sum(need) + 2, bs, kv_heads, dim, generator=g).bfloat16() for _ in "kv")
    q = torch.randn(batch, heads, dim, generator=g).bfloat16()
    meta = make_metadata(is_prefill=False, query_lens=[1] * batch, kv_lens=lens, block_tables=tables,
                         slot_mapping=list(range(batch)), device="cpu")  # fmt: skip
    torch_path, kernel = TorchAttentionBackend(), TorchAttentionBackend(decode_kernels())
    scale = dim**-0.5
    err = (kernel.decode(q, k, v, meta, scale).float() - torch_path.decode(q.float(), k.float(), v.float(), meta,
                                                                          scale)).abs().max().item()  # fmt: skip
    ms = cpu_ms({"torch": lambda: torch_path.decode(q, k, v, meta, scale),
                 "kernel": lambda: kernel.decode(q, k, v, meta, scale)}, rounds)  # fmt: skip
    return {"what": f"paged attention, {batch} seqs, mean ctx {sum(lens) / batch:.0f}", **ms, "max_abs_err": err}


def greedy_case(batch: int, rounds: int) -> dict:
    logits = (torch.randn(batch, 49152, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    rows = [Row() for _ in range(batch)]
    torch_path, kernel = Sampler("cpu", seed=0), Sampler("cpu", seed=0, greedy=greedy_kernel())
    a, b = torch_path(logits, rows), kernel(logits, rows)
    assert a.token_ids == b.token_ids
    err = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
    ms = cpu_ms({"torch": lambda: torch_path(logits, rows), "kernel": lambda: kernel(logits, rows)}, rounds)
    return {"what": f"greedy sampling, {batch} rows x 49152", **ms, "max_abs_err": err}


def norm_case(batch: int, rounds: int) -> dict:
    norm = RMSNorm(576, 1e-5).bfloat16()
    x = torch.randn(batch, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    ref = norm(x)
    fast = RMSNorm(576, 1e-5).bfloat16()
    fast.kernel = norm_kernel()
    err = (fast(x).float() - ref.float()).abs().max().item()
    ms = cpu_ms({"torch": lambda: norm(x), "kernel": lambda: fast(x)}, rounds * 20)
    return {"what": f"RMSNorm, {batch} rows x 576", **ms, "max_abs_err": err}


def add_norm_case(batch: int, rounds: int) -> dict:
    norm = RMSNorm(576, 1e-5).bfloat16()
    norm.kernel = norm_kernel()
    g = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(batch, 576, generator=g).bfloat16() for _ in "xr")
    summed, normed = norm.add_and_norm(x, residual)
    assert torch.equal(summed, residual + x) and torch.equal(normed, norm(residual + x))
    ms = cpu_ms({"torch": lambda: norm(residual + x), "kernel": lambda: norm.add_and_norm(x, residual)}, rounds * 20)
    return {"what": f"residual add + RMSNorm, {batch} rows x 576", **ms, "max_abs_err": 0.0}


def kv_write_case(batch: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(batch, 15, 64, generator=g).bfloat16()
    k, v = qkv[:, 9:12], qkv[:, 12:]  # views into the projection, as the attention module passes them
    pools = {name: [torch.zeros(4096, 16, 3, 64, dtype=torch.bfloat16) for _ in "kv"] for name in ("torch", "kernel")}
    slots = torch.randperm(4096 * 16, generator=g)[:batch]
    backends = {"torch": TorchAttentionBackend(), "kernel": TorchAttentionBackend(decode_kernels())}
    for name, b in backends.items():
        b.write_kv(k, v, *pools[name], slots)
    assert all(torch.equal(a, b) for a, b in zip(pools["torch"], pools["kernel"]))
    ms = cpu_ms({name: (lambda b=b, p=pools[name]: b.write_kv(k, v, *p, slots)) for name, b in backends.items()},
                rounds * 20)  # fmt: skip
    return {"what": f"KV write, {batch} tokens x 3 kv heads x 64", **ms, "max_abs_err": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if decode_kernels() is None:
        raise SystemExit("no compiled CPU kernels on this machine (needs g++ on x86-64 Linux)")
    rows = [attention_case(args.batch, args.rounds), greedy_case(args.batch, args.rounds),
            norm_case(args.batch, args.rounds), add_norm_case(args.batch, args.rounds),
            kv_write_case(args.batch, args.rounds)]  # fmt: skip
    print(f"| what | torch ms (CPU) | kernel ms (CPU) | speedup | max abs diff |\n|---|---:|---:|---:|---:|")
    for r in rows:
        r["speedup"] = r["torch"] / r["kernel"]
        print(f"| {r['what']} | {r['torch']:.3f} | {r['kernel']:.3f} | {r['speedup']:.1f}x | {r['max_abs_err']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
