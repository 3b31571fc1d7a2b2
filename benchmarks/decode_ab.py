"""A/B of the compiled CPU kernels against torch's own ops, interleaved in one process.

    python benchmarks/decode_ab.py --batch-size 1 --steps 30

Two measurements, alternating the variants each round so that machine noise
hits them alike: (1) the model's decode linears alone (every projection of
the 30 layers + the output head, the shapes of the default model, one row
each), compiled matvec against oneDNN's packed linear; and (2) full shard
decode steps of the default model (forward_ns as the shard reports it), in
three variants switched between steps: `fused` (the default: whole-layer
kernel at batch 1, paged-attention kernel above it), `matvec` (the module
path with the matvec kernel and torch attention) and `onednn` (no compiled
kernel at all). Prints medians and minima; on a shared machine compare the
ratios, not the absolute times. float32 only (the default model loads in
float32 here); bfloat16 against float32 and the memory floor:
benchmarks/bf16_ab.py.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)


def linears_ab(rounds: int) -> dict:
    from pagemill.cpu_kernels.matvec import matvec_kernel

    kernel = matvec_kernel()
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
    ws = [torch.randn(n, k) for _ in range(30) for n, k in shapes] + [torch.randn(49152, 576)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
    xs = {k: torch.randn(1, k) for k in (576, 1536)}
    nbytes = sum(w.numel() * 4 for w in ws)

    def run(kind):
        for w, p in zip(ws, packed):
            x = xs[w.shape[1]]
            if kind == "kernel":
                kernel(x, w, None)
            else:
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    times = {"kernel": [], "onednn": []}
    for _ in range(rounds):
        for kind in times:
            t = time.perf_counter()
            run(kind)
            times[kind].append(time.perf_counter() - t)
    return {k: {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3,
                "best_gbs": nbytes / min(v) / 1e9} for k, v in times.items()}  # fmt: skip


def decode_ab(batch_size: int, steps: int) -> dict:
    from pagemill.bench.cli import resolve_model_dir
    from pagemill.bench.shard_driver import ShardDriver, random_prompts, warm_runner
    from pagemill.config import ShardConfig
    from pagemill.models.packed_linear import PackedLinear
    from pagemill.shard.model_runner import ModelRunner

    runner = ModelRunner.from_shard_config(ShardConfig(model_dir=resolve_model_dir(None), uds_path="", dtype="float32"))
    warm_runner(runner, max_batch_size=batch_size, max_prefill_tokens=batch_size * 64, max_input=64 + 2 * steps + 2)
    model = runner.model
    lin = [m for m in model.modules() if isinstance(m, PackedLinear)]
    kernels, fused, attn = [m.matvec for m in lin], model.model.fused, model.backend.kernels
    d = ShardDriver(runner)
    batch, _ = d.prefill(random_prompts(batch_size, 64, runner.config.vocab_size), max_new_tokens=3 * steps + 1)
    times = {"fused": [], "matvec": [], "onednn": []}
    for _ in range(steps):
        for kind in times:
            for m, k in zip(lin, kernels):
                m.matvec = None if kind == "onednn" else k
            model.model.fused = fused if kind == "fused" else None
            model.backend.kernels = attn if kind == "fused" else None
            times[kind].append(d.decode(batch).forward_ns / 1e6)
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v)} for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    with torch.inference_mode():
        for name, res in (("linears", linears_ab(a.rounds)), ("decode step", decode_ab(a.batch_size, a.steps))):
            first = next(iter(res))
            ratios = ", ".join(f"{k}/{first} {res[k]['median_ms'] / res[first]['median_ms']:.2f}" for k in res
                               if k != first)  # fmt: skip
            print(name, {k: {m: round(x, 1) for m, x in v.items()} for k, v in res.items()}, f"median ratios: {ratios}")


if __name__ == "__main__":
    main()
