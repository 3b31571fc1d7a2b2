"""bfloat16 against float32 on the CPU, interleaved in one process, against the memory floor.

    python benchmarks/bf16_ab.py --batch-sizes 1,2,3,4,5,6,8,64 --steps 12 --json benchmarks/results/bf16-ab/bf16_ab-1thread.json

Three measurements (the variants alternate within each round, so machine
noise hits them alike; medians and minima; on a shared machine compare the
ratios):

1. linears: every decode projection of the default model (30 layers + the
   output head) at 1..8 and 64 rows of bf16: the compiled matvec with
   vdpbf16ps and with widening, oneDNN's packed bf16 weight, plain F.linear
   (oneDNN on unpacked weights): which multiply pays per row count, and
   whether the packed second copy of the weights still pays in bf16;
2. decode steps of the default model (forward_ns as the shard reports it),
   a bfloat16 and a float32 shard side by side: `bf16 fused` (the default;
   whole-layer kernel up to its threshold, then packed oneDNN + in-place
   attention), `bf16 fused dpbf16` / `bf16 fused widen` (the multiply forced, and the
   fused layer up to 8 sequences, past its threshold),
   `bf16 module` (no whole-layer kernel), `bf16 unpacked` (module path with
   F.linear instead of the packed copy), and `f32 fused` (float32's default);
3. the memory floor of a step at each batch size (bench/roofline.py),
   bandwidth measured before and after the steps (the better one), with the
   weights in bf16 and in float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

import _repo  # noqa: E402,F401  (the repository from this file's path)

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def linears_ab(rows: int, rounds: int) -> dict:
    from pagemill.cpu_kernels.matvec import matvec_kernel

    kernel = matvec_kernel()
    ws = [torch.randn(n, k).bfloat16() for _ in range(30) for n, k in SHAPES] + [torch.randn(49152, 576).bfloat16()]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
    xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
    nbytes = sum(w.numel() * 2 for w in ws)
    kinds = ["packed", "F.linear"] + (["dpbf16", "widen"] if rows <= kernel.max_rows else [])

    def run(kind):
        for w, p in zip(ws, packed):
            x = xs[w.shape[1]]
            if kind == "packed":
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            elif kind == "F.linear":
                F.linear(x, w)
            else:
                kernel(x, w, None, kind)

    times = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind in kinds:
            t = time.perf_counter()
            run(kind)
            times[kind].append(time.perf_counter() - t)
    return {k: {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3,
                "best_gbs": nbytes / min(v) / 1e9} for k, v in times.items()}  # fmt: skip


class Shard:
    """A warmed shard of the default model in one dtype, with switches for its CPU paths."""

    def __init__(self, dtype: str, batch_size: int, steps: int, rounds_per_step: int) -> None:
        from pagemill.bench.cli import resolve_model_dir
        from pagemill.bench.shard_driver import ShardDriver, random_prompts, warm_runner
        from pagemill.config import ShardConfig
        from pagemill.models.packed_linear import PackedLinear
        from pagemill.shard.model_runner import ModelRunner

        kv = (512 if dtype == "float32" else 256) << 20
        cfg = ShardConfig(model_dir=resolve_model_dir(None), uds_path="", dtype=dtype, kv_cache_memory=kv)
        self.runner = ModelRunner.from_shard_config(cfg)
        new_tokens = rounds_per_step * steps + 2
        warm_runner(self.runner, max_batch_size=batch_size, max_prefill_tokens=batch_size * 64,
                    max_input=64 + new_tokens + 1)  # fmt: skip
        model = self.runner.model
        self.linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
        self.packed = [m.packed for m in self.linears]
        self.fused = model.model.fused
        self.max_batch = self.fused and self.fused.max_batch
        self.driver = ShardDriver(self.runner)
        prompts = random_prompts(batch_size, 64, self.runner.config.vocab_size)
        self.batch, _ = self.driver.prefill(prompts, max_new_tokens=new_tokens)

    def step(self, fused: bool = True, packed: bool = True, mul: str = "auto") -> float:
        """mul other than "auto" forces the fused layer up to the most rows it takes."""
        self.runner.model.model.fused = self.fused if fused else None
        if self.fused is not None:
            self.fused.mul = mul
            self.fused.max_batch = self.max_batch if mul == "auto" else self.fused._kernels.layer_max_rows
        for m, p in zip(self.linears, self.packed):
            m.packed = p if packed else None
        ms = self.driver.decode(self.batch).forward_ns / 1e6
        for m, p in zip(self.linears, self.packed):
            m.packed = p
        return ms

    def context(self) -> int:
        return max(self.driver.lens.values())

    def weight_bytes(self) -> dict:
        params = {p.data_ptr(): p.numel() * p.element_size() for p in self.runner.model.parameters()}
        packed = sum(p.numel() * p.element_size() for p in self.packed if p is not None)
        return {"weights_mb": sum(params.values()) / 1e6, "packed_copy_mb": packed / 1e6}


VARIANTS = {
    "bf16 fused": ("bfloat16", {}),
    "bf16 fused dpbf16": ("bfloat16", {"mul": "dpbf16"}),
    "bf16 fused widen": ("bfloat16", {"mul": "widen"}),
    "bf16 module": ("bfloat16", {"fused": False}),
    "bf16 unpacked": ("bfloat16", {"fused": False, "packed": False}),
    "f32 fused": ("float32", {}),
}


def decode_ab(batch_size: int, steps: int) -> dict:
    from pagemill.cpu_kernels.decode import decode_kernels

    # The forced fused variants and the module path up to the most rows the layer takes.
    names = [n for n in VARIANTS if batch_size <= decode_kernels().layer_max_rows or n in ("bf16 fused",
             "bf16 unpacked", "f32 fused")]  # fmt: skip
    per_shard = {d: sum(VARIANTS[n][0] == d for n in names) for d in ("bfloat16", "float32")}
    shards = {d: Shard(d, batch_size, steps, k) for d, k in per_shard.items()}
    times = {n: [] for n in names}
    for _ in range(steps):
        for n in names:
            dtype, switches = VARIANTS[n]
            times[n].append(shards[dtype].step(**switches))
    res = {n: {"median_ms": statistics.median(v), "min_ms": min(v)} for n, v in times.items()}
    res["_context"] = shards["bfloat16"].context()
    res["_memory"] = {d: s.weight_bytes() for d, s in shards.items()}
    return res


def main() -> None:
    from pagemill.bench.cli import resolve_model_dir
    from pagemill.bench.roofline import decode_floor, measure_machine
    from pagemill.models.auto_dtype import cpu_flags
    from pagemill.models.config import ModelConfig

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch-sizes", default="1,2,3,4,5,6,8,64")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=7, help="rounds of the linears A/B")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2", "fma")))
    out: dict = {"cpu_flags": flags, "threads": torch.get_num_threads(), "linears": {}, "decode": {}}
    print("cpu flags:", " ".join(flags), "| threads:", torch.get_num_threads())
    with torch.inference_mode():
        machine = measure_machine()
        for rows in sorted({min(b, 8) for b in batch_sizes} | ({64} if 64 in batch_sizes else set())):
            res = out["linears"][rows] = linears_ab(rows, a.rounds)
            print(f"linears {rows:3d} rows:", {k: f"{v['median_ms']:.1f} ms {v['best_gbs']:.1f} GB/s"
                                               for k, v in res.items()})  # fmt: skip
        for b in batch_sizes:
            res = out["decode"][b] = decode_ab(b, a.steps)
            print(f"decode batch {b:3d}:", {k: round(v["median_ms"], 1) for k, v in res.items() if k[0] != "_"},
                  "memory", res["_memory"])  # fmt: skip
        after = measure_machine()
    machine = max(machine, after, key=lambda m: m.bandwidth_gbs)
    cfg = ModelConfig.from_model_dir(str(resolve_model_dir(None)))
    out["machine"] = asdict(machine)
    out["floors"] = {}
    for b in batch_sizes:
        ctx = out["decode"][b]["_context"]
        floors = {k: asdict(decode_floor(cfg, machine, b, ctx, nbytes)) for k, nbytes in (("bf16", 2), ("f32", 4))}
        out["floors"][b] = floors
        d = out["decode"][b]
        print(f"batch {b:3d} ctx {ctx}: memory floor bf16 {floors['bf16']['memory_ms']:.1f} ms "
              f"f32 {floors['f32']['memory_ms']:.1f} ms ({machine.bandwidth_gbs:.1f} GB/s); bf16 fused / floor "
              f"{d['bf16 fused']['median_ms'] / floors['bf16']['memory_ms']:.2f}, f32 fused / floor "
              f"{d['f32 fused']['median_ms'] / floors['f32']['memory_ms']:.2f}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
