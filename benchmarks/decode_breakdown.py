"""Where one small-batch decode step of the shard goes, part by part, against its memory floor.

    python benchmarks/decode_breakdown.py --dtype bfloat16 --threads 2 --steps 200 \
        --json benchmarks/results/decode-breakdown/bf16-b1.json

Drives a ModelRunner of the default model in process (BlockRouter, no HTTP or
gRPC), and times each part of every decode step with perf_counter_ns by
wrapping it: the Step message's decode and the reply's encode (what the
shard's gRPC handler does around the model thread), request checks and
bookkeeping, step inputs (token/position/slot tensors and attention
metadata), embedding, rotary cos/sin, the layers (the fused kernel), the
final norm, the output head (logits), sampling, and the rest of
ModelRunner.step (Generation messages, finishes). Prints median ms per part,
its share of the step, and the memory floor of the parts that read weights
(bytes / the bandwidth measured in the same run: a read of a 1 GiB buffer
with the same thread count). The router side (scheduling, HTTP streaming,
detokenising, the gRPC transport) is not in here: the server's /metrics
gives it (pagemill_decode_step_seconds_total against
pagemill_decode_forward_seconds_total), see docs/cpu.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)

CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.process_time_ns}
PARTS = ["proto", "inputs", "embed", "rotary", "layers", "norm", "head", "sample", "other"]


class Timer:
    def __init__(self, clock) -> None:
        self.clock = clock  # time.perf_counter_ns (wall) or time.process_time_ns (CPU, all threads)
        self.ns: dict[str, int] = defaultdict(int)
        self.active: set[str] = set()

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            if name in self.active:  # already timed by an outer call (add_and_norm's torch path calls forward)
                return fn(*a, **kw)
            self.active.add(name)
            t = self.clock()
            try:
                return fn(*a, **kw)
            finally:
                self.ns[name] += self.clock() - t
                self.active.discard(name)

        return timed


class TimedFused:
    """The fused decoder with its call timed (everything else passes through: the shard's
    thread chooser reads its dtype and max_batch)."""

    def __init__(self, fused, timer: Timer) -> None:
        self._fused, self._call = fused, timer.wrap("layers", fused.__call__)

    def __getattr__(self, name):
        return getattr(self._fused, name)

    def __call__(self, *a):
        return self._call(*a)


class TimedSampler:
    def __init__(self, sampler, timer: Timer) -> None:
        self._sampler, self._call = sampler, timer.wrap("sample", sampler.__call__)

    def __getattr__(self, name):
        return getattr(self._sampler, name)

    def __call__(self, *a, **kw):
        return self._call(*a, **kw)


def instrument(runner, timer: Timer) -> None:
    import pagemill.shard.model_runner as engine

    engine.build_inputs = timer.wrap("inputs", engine.build_inputs)
    inner = runner.model.model
    inner.embed_tokens.forward = timer.wrap("embed", inner.embed_tokens.forward)
    inner.rotary.cos_sin = timer.wrap("rotary", inner.rotary.cos_sin)
    if inner.fused is not None:
        inner.fused = TimedFused(inner.fused, timer)
    if getattr(inner, "batched", None) is not None:  # bf16 steps above the fused layer's batch
        inner.batched = TimedFused(inner.batched, timer)
    for layer in inner.layers:  # batches past the fused kernel's: the per-layer modules
        layer.forward = timer.wrap("layers", layer.forward)
    inner.norm.forward = timer.wrap("norm", inner.norm.forward)
    if hasattr(inner.norm, "add_and_norm"):  # the last layer's residual add and the final norm, in one
        inner.norm.add_and_norm = timer.wrap("norm", inner.norm.add_and_norm)
    # What the engine calls for the sampled rows (head_logits: the head's dtype; before it,
    # compute_logits: widened to float32).
    head = "head_logits" if hasattr(runner.model, "head_logits") else "compute_logits"
    setattr(runner.model, head, timer.wrap("head", getattr(runner.model, head)))
    runner.sampler = TimedSampler(runner.sampler, timer)


def weight_bytes(model) -> dict[str, int]:
    layers = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return {"layers": layers, "head": head}


def bandwidth_gbs(clock, mib: int = 1024, repeats: int = 7) -> float:
    """Read bandwidth as bench/roofline.py takes it: the best of `repeats` reads of a float32
    buffer far beyond the caches, in huge pages (as the weights are), by torch's sum and by the
    compiled plain read where it builds, timed with `clock` (ns)."""
    from pagemill.bench.roofline import read_buffer, readers

    a = read_buffer(mib)
    fns = readers(a)
    for fn in fns:
        fn()
    best = min(_timed(fn, clock) for fn in fns for _ in range(repeats))
    return a.numel() * 4 / best


def _timed(fn, clock) -> int:
    t = clock()
    fn()
    return clock() - t


def run(dtype: str, threads: int, batch: int, steps: int, prompt: int, clock: str, adaptive: bool,
        huge_pages: bool = True) -> dict:
    from pagemill.bench.cli import resolve_model_dir
    from pagemill.bench.shard_driver import random_prompts, warm_runner
    from pagemill.config import ShardConfig
    from pagemill.proto import pb
    from pagemill.shard.model_runner import ModelRunner
    from pagemill.bench.block_router import BlockRouter, step_response

    torch.set_num_threads(threads)
    bw_before = bandwidth_gbs(CLOCKS[clock])
    runner = ModelRunner.from_shard_config(ShardConfig(model_dir=resolve_model_dir(None), uds_path="", dtype=dtype,
                                                         adaptive_threads=adaptive, huge_pages=huge_pages))
    total = prompt + steps + 2
    warm_runner(runner, max_batch_size=batch, max_prefill_tokens=batch * prompt, max_input=total)
    timer = Timer(CLOCKS[clock])
    now = timer.clock

    # As the service does: parse the request bytes, step, build and encode the reply.
    def step(req: pb.StepRequest) -> pb.StepResponse:
        wire = req.SerializeToString()  # the router's encode, outside the shard's clock
        t = now()
        parsed = pb.StepRequest.FromString(wire)
        timer.ns["proto"] += now() - t
        t = now()
        result = runner.step(parsed)
        timer.ns["step"] += now() - t
        t = now()
        wire = step_response(result).SerializeToString()
        timer.ns["proto"] += now() - t
        return pb.StepResponse.FromString(wire)  # the router's decode, outside the clock

    router = BlockRouter(step, runner.pool.num_blocks, runner.block_size)
    params = pb.NextTokenChooserParameters(repetition_penalty=1.0)
    for rid, ids in enumerate(random_prompts(batch, prompt, runner.config.vocab_size)):
        router.add(rid, ids, steps + 1, params=params, ignore_eos=True)
    router.step()  # the prefill
    instrument(runner, timer)
    samples: list[dict[str, float]] = []
    for _ in range(steps):
        timer.ns.clear()
        router.step()
        ns = {p: 0 for p in PARTS} | dict(timer.ns)
        inside = sum(ns.get(p, 0) for p in PARTS if p not in ("proto", "other"))
        ns["other"] = ns["step"] - inside
        ns["total"] = ns["step"] + ns["proto"]
        samples.append({k: v / 1e6 for k, v in ns.items()})
    bw = max(bw_before, bandwidth_gbs(CLOCKS[clock]))
    med = {k: statistics.median(s[k] for s in samples) for k in PARTS + ["total"]}
    best = {k: min(s[k] for s in samples) for k in PARTS + ["total"]}
    wb = weight_bytes(runner.model)
    floors = {k: v / bw / 1e6 for k, v in wb.items()}
    return {"dtype": dtype, "threads": threads, "clock": clock, "batch": batch, "steps": steps, "prompt": prompt,
            "bandwidth_gbs": bw, "weight_bytes": wb, "floor_ms": floors, "median_ms": med, "min_ms": best,
            "cpu_flags": _cpu_flags()}  # fmt: skip


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if "avx512" in f or "amx" in f)
    except OSError:
        pass
    return []


def table(res: dict) -> str:
    med, best, floors = res["median_ms"], res["min_ms"], res["floor_ms"]
    total = med["total"]
    rows = ["| part | median ms | % of step | min ms | floor ms |", "| --- | ---: | ---: | ---: | ---: |"]
    for p in PARTS:
        f = floors.get(p)
        rows.append(f"| {p} | {med[p]:.2f} | {100 * med[p] / total:.0f}% | {best[p]:.2f} | {'' if f is None else f'{f:.2f}'} |")
    rows.append(f"| **step** | **{total:.2f}** | 100% | {best['total']:.2f} | {sum(floors.values()):.2f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="cpu: process CPU time (use with --threads 1 on a shared machine)")
    p.add_argument("--no-huge-pages", action="store_true", help="weights and pool in plain 4 KiB pages")
    p.add_argument("--adaptive-threads", action="store_true",
                   help="let the shard run small steps on one thread when faster (shard/threads.py); off: "
                        "every step runs --threads")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with torch.inference_mode():
        res = run(a.dtype, a.threads, a.batch_size, a.steps, a.prompt_len, a.clock, a.adaptive_threads,
                  not a.no_huge_pages)
    print(f"{res['dtype']}, batch {res['batch']}, {res['threads']} threads, {res['clock']} clock, bandwidth {res['bandwidth_gbs']:.1f} GB/s")
    print(table(res))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
