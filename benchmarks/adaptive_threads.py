"""Small-batch decode with a fixed thread count against the shard's adaptive choice (shard/threads.py).

    python benchmarks/adaptive_threads.py --threads 2 --batch-size 1 --rounds 6 --block 32 \
        --json benchmarks/results/adaptive-threads/adaptive.json

One bf16 shard of the default model in process (BlockRouter, greedy, 64-token
prompts); blocks of `--block` decode steps alternate between `fixed` (all
`--threads` every step), `one` (one thread) and `adaptive` (the chooser, its
estimates kept across blocks). Wall clock per step (runner.step), medians
over all blocks; on a loaded machine the spread is the point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    from pagemill.bench.cli import resolve_model_dir
    from pagemill.bench.shard_driver import ShardDriver, random_prompts, warm_runner
    from pagemill.config import ShardConfig
    from pagemill.shard.model_runner import ModelRunner

    torch.set_num_threads(a.threads)
    runner = ModelRunner.from_shard_config(ShardConfig(model_dir=resolve_model_dir(None), uds_path="", dtype=a.dtype))
    steps = 3 * a.rounds * a.block + 2
    warm_runner(runner, max_batch_size=a.batch_size, max_prefill_tokens=a.batch_size * 64, max_input=64 + steps + 2)
    d = ShardDriver(runner)
    batch, _ = d.prefill(random_prompts(a.batch_size, 64, runner.config.vocab_size), max_new_tokens=steps)
    modes = {"fixed": (False, a.threads), "one": (False, 1), "adaptive": (True, a.threads)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(a.rounds):
        for mode, (adaptive, threads) in modes.items():
            runner.adaptive_threads = adaptive
            torch.set_num_threads(threads)
            for _ in range(a.block):
                t = time.perf_counter_ns()
                d.decode(batch)
                times[mode].append((time.perf_counter_ns() - t) / 1e6)
    torch.set_num_threads(a.threads)
    res = {m: {"median_ms": statistics.median(v), "mean_ms": statistics.fmean(v), "min_ms": min(v)}
           for m, v in times.items()}  # fmt: skip
    choice = runner.thread_choices.get(a.batch_size)
    print(f"{a.dtype}, batch {a.batch_size}, {a.threads} threads, {a.rounds} rounds of {a.block} steps per mode")
    print("| mode | median ms | mean ms | min ms |\n| --- | ---: | ---: | ---: |")
    for m, r in res.items():
        print(f"| {m} | {r['median_ms']:.2f} | {r['mean_ms']:.2f} | {r['min_ms']:.2f} |")
    if choice is not None:
        print("adaptive estimates (ms):", {c: round(e / 1e6, 2) for c, e in choice.estimate.items()})
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "result": res}, indent=2))


if __name__ == "__main__":
    main()
