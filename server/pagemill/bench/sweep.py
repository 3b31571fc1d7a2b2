"""Shard-level sweep over batch sizes, bypassing HTTP and gRPC (TGI's `benchmark`).

For each batch size B: one prefill of B prompts of input_len tokens, then
`steps` decode steps of the whole batch. Reported per B: prefill latency and
tokens/s, decode step latency (median over steps) and tokens/s, and the
shard's own Python bookkeeping per decode step (runner.step wall time
minus the forward_ns it reports: request checks, input tensors, Generation
messages), which is part of what the router sees as step time. Given the
machine measured in the same run (bench/roofline.py), each decode step is
also shown against its floor at that batch and mean context, with the term
that binds.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from pagemill.bench.roofline import Machine, decode_floor
from pagemill.bench.shard_driver import ShardDriver, random_prompts, warm_runner
from pagemill.shard.model_runner import ModelRunner


@dataclass
class SweepPoint:
    batch_size: int
    input_len: int
    prefill_ms: float
    prefill_tok_s: float
    decode_ms: float  # median step, forward_ns as the shard reports it
    decode_wall_ms: float  # median runner.decode wall time
    decode_tok_s: float
    shard_overhead_ms: float  # decode_wall_ms - decode_ms
    decode_min_ms: float
    floor_ms: float | None = None  # roofline floor of the step (None: no machine measured)
    x_floor: float | None = None  # decode_ms / floor_ms
    binds: str | None = None  # "memory" or "compute"


def run_sweep(runner: ModelRunner, batch_sizes: list[int], input_len: int, steps: int,
              repeats: int = 1, progress=None, machine: Machine | None = None) -> list[SweepPoint]:  # fmt: skip
    warm_runner(runner, max_batch_size=max(batch_sizes), max_prefill_tokens=max(batch_sizes) * input_len,
                max_input=input_len + steps + 1)  # fmt: skip
    driver = ShardDriver(runner)
    points = []
    for b in batch_sizes:
        prefills, fwd, wall = [], [], []
        for rep in range(repeats):
            prompts = random_prompts(b, input_len, runner.config.vocab_size, seed=b * 100 + rep)
            batch, step = driver.prefill(prompts, max_new_tokens=steps + 1)
            prefills.append(step.forward_ns / 1e6)
            for _ in range(steps):
                s = driver.decode(batch)
                fwd.append(s.forward_ns / 1e6)
                wall.append(s.wall_ns / 1e6)
            for rid in batch:
                driver.release(rid)
        pre, dec, dwall = statistics.median(prefills), statistics.median(fwd), statistics.median(wall)
        # The floor in the shard's own dtype (`--dtype auto` may have picked bf16: half the bytes).
        floor = None if machine is None else decode_floor(runner.config, machine, b, input_len + (steps + 1) // 2,
                                                          runner.dtype.itemsize)  # fmt: skip
        points.append(SweepPoint(
            batch_size=b, input_len=input_len, prefill_ms=pre, prefill_tok_s=b * input_len / pre * 1e3,
            decode_ms=dec, decode_wall_ms=dwall, decode_tok_s=b / dwall * 1e3, shard_overhead_ms=dwall - dec,
            decode_min_ms=min(fwd), floor_ms=floor and floor.floor_ms, x_floor=floor and dec / floor.floor_ms,
            binds=floor and floor.binds,
        ))  # fmt: skip
        if progress is not None:
            progress(points[-1])
    return points


def sweep_table(points: list[SweepPoint]) -> str:
    rows = ["| batch | prefill ms | prefill tok/s | decode ms (median) | decode tok/s | shard overhead ms "
            "| floor ms | x floor | binds |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for p in points:
        floor = "| - | - | - |" if p.floor_ms is None else f"| {p.floor_ms:.1f} | {p.x_floor:.2f} | {p.binds} |"
        rows.append(f"| {p.batch_size} | {p.prefill_ms:.1f} | {p.prefill_tok_s:.0f} | {p.decode_ms:.1f} | "
                    f"{p.decode_tok_s:.1f} | {p.shard_overhead_ms:.2f} {floor}")  # fmt: skip
    return "\n".join(rows)


def as_dicts(points: list[SweepPoint]) -> list[dict]:
    return [asdict(p) for p in points]
