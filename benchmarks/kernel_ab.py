"""Two builds of the CPU kernel library side by side in one process: whole steps of one model
through ModelRunner, every compiled kernel it holds swapped between the builds step by step
(A, B, B, A, ...), so both see the same weights, the same KV blocks and the same minute of the
machine. This is how a kernel change is measured before it goes end to end (docs/cpu.md).

    python benchmarks/kernel_ab.py --lib-a before.so --lib-b after.so decode --batch 64 --prompt 150 --steps 40
    python benchmarks/kernel_ab.py --lib-a before.so --lib-b after.so prefill --batch 14 --prompt 146 --reps 9

A library is what pagemill.cpu_kernels.build makes (`cpu-kernels-<key>.so` under
$PAGEMILL_KERNEL_CACHE, default ~/.cache/pagemill/kernels): build the one of another tree with
`PYTHONPATH=<tree>/server PAGEMILL_KERNEL_CACHE=/tmp/a python -c "from pagemill.cpu_kernels.build
import library; print(library()._name)"`. Both libraries must take the same arguments (one
source tree's entry points): what is compared is their code, not their interface.
decode: `--batch` sequences of `--prompt` random tokens, prefilled, then timed decode steps.
prefill: one step of `--batch` fresh prompts, timed `--reps` times per library.
Prints median ms per library and B/A; `--json` writes them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import _repo  # noqa: F401  (the repository from this file's path)


def kernel_classes() -> tuple[type, ...]:
    """The binding classes whose instances the model, the attention backend and the sampler hold."""
    from pagemill.cpu_kernels.decode import DecodeKernels
    from pagemill.cpu_kernels.gemm import GemmBf16Kernel
    from pagemill.cpu_kernels.int8 import Int8LinearKernel
    from pagemill.cpu_kernels.matvec import MatvecKernel
    from pagemill.cpu_kernels.rowwise import ElementwiseKernels, GreedyKernel, NormKernel

    return DecodeKernels, GemmBf16Kernel, Int8LinearKernel, MatvecKernel, ElementwiseKernels, GreedyKernel, NormKernel


def holders(root, classes: tuple[type, ...]) -> list[tuple[object, str, type]]:
    """(object, attribute, binding class) of every kernel binding reachable from `root` through
    pagemill's own objects and torch modules."""
    import torch

    seen, found, todo = set(), [], [root]
    while todo:
        o = todo.pop()
        if id(o) in seen or not hasattr(o, "__dict__"):
            continue
        seen.add(id(o))
        attrs = dict(vars(o))
        if isinstance(o, torch.nn.Module):
            attrs.update(o._modules)
        for name, v in attrs.items():
            if isinstance(v, classes):
                found.append((o, name, type(v)))
            elif isinstance(v, torch.nn.Module) or type(v).__module__.startswith("pagemill."):
                todo.append(v)
    return found


class Swapper:
    """Points every kernel binding a runner holds (and the process-wide ones) at library A or B."""

    def __init__(self, runner, libs: dict[str, str]) -> None:
        from pagemill.cpu_kernels import build

        self._state = build._state
        self._saved = dict(build._state)  # the process-wide bindings, put back by restore()
        classes = kernel_classes()
        self.points = holders(runner, classes)
        loaded = {label: ctypes.CDLL(path) for label, path in libs.items()}
        shared = {key: type(v) for key, v in build._state.items() if isinstance(v, classes)}
        self.kernels = {label: {cls: cls(lib) for cls in {*(c for _, _, c in self.points), *shared.values()}}
                        for label, lib in loaded.items()}  # fmt: skip
        self.loaded, self.shared = loaded, shared

    def use(self, label: str) -> None:
        for owner, name, cls in self.points:
            setattr(owner, name, self.kernels[label][cls])
        for key, cls in self.shared.items():
            self._state[key] = self.kernels[label][cls]
        self._state["lib"] = self.loaded[label]

    def restore(self) -> None:
        """The process-wide bindings as they were before: a caller in the same process (a test)
        keeps the library it loaded."""
        self._state.clear()
        self._state.update(self._saved)


def runner_for(model: str | None, dtype: str, threads: int, max_input: int, batch: int):
    import torch

    from pagemill.bench.cli import resolve_model_dir
    from pagemill.bench.shard_driver import warm_runner
    from pagemill.config import ShardConfig
    from pagemill.shard.model_runner import ModelRunner

    torch.set_num_threads(threads)
    runner = ModelRunner.from_shard_config(ShardConfig(model_dir=resolve_model_dir(model), uds_path="", dtype=dtype))
    warm_runner(runner, max_batch_size=batch + 16, max_prefill_tokens=max(2048, max_input), max_input=max_input)
    return runner


def alternate(n: int, swap: Swapper, one) -> dict[str, list[float]]:
    """`one()` timed n times per library, A B B A ... (ms)."""
    times: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(n):
        for label in ("A", "B") if i % 2 == 0 else ("B", "A"):
            swap.use(label)
            start = time.perf_counter()
            one(label)
            times[label].append((time.perf_counter() - start) * 1e3)
    return times


def decode_ab(runner, swap: Swapper, batch: int, prompt: int, steps: int) -> dict[str, list[float]]:
    from pagemill.bench.block_router import BlockRouter
    from pagemill.bench.shard_driver import random_prompts
    from pagemill.proto import pb

    router = BlockRouter.for_runner(runner)
    params = pb.NextTokenChooserParameters(repetition_penalty=1.0)
    for rid, ids in enumerate(random_prompts(batch, prompt, runner.config.vocab_size)):
        router.add(rid, ids, 2 * steps + 8, params=params, ignore_eos=True)
    swap.use("A")
    for _ in range(4):  # the prefill, then a few decode steps to warm both paths
        router.step()
    return alternate(steps, swap, lambda _: router.step())


def prefill_ab(runner, swap: Swapper, batch: int, prompt: int, reps: int) -> dict[str, list[float]]:
    from pagemill.bench.block_router import BlockRouter
    from pagemill.bench.shard_driver import random_prompts
    from pagemill.proto import pb

    params = pb.NextTokenChooserParameters(repetition_penalty=1.0)
    prompts = random_prompts(batch, prompt, runner.config.vocab_size)

    def one(_label: str) -> None:
        router = BlockRouter.for_runner(runner)
        for rid, ids in enumerate(prompts):
            router.add(rid, ids, 1, params=params, ignore_eos=True)
        router.step()

    return alternate(reps, swap, one)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib-a", required=True, help="the first build's .so (the baseline)")
    p.add_argument("--lib-b", required=True, help="the second build's .so")
    p.add_argument("--model", default=None, help="HF model directory (default: the default model)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the medians and every timing here")
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("decode", help="decode steps of a running batch")
    d.add_argument("--batch", type=int, default=64)
    d.add_argument("--prompt", type=int, default=150)
    d.add_argument("--steps", type=int, default=40)
    f = sub.add_parser("prefill", help="one prefill step of fresh prompts")
    f.add_argument("--batch", type=int, default=14)
    f.add_argument("--prompt", type=int, default=146)
    f.add_argument("--reps", type=int, default=9)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    n = a.steps if a.what == "decode" else a.reps
    runner = runner_for(a.model, a.dtype, a.threads, a.prompt + 2 * n + 16, a.batch)
    swap = Swapper(runner, {"A": a.lib_a, "B": a.lib_b})
    run = decode_ab if a.what == "decode" else prefill_ab
    try:
        times = run(runner, swap, a.batch, a.prompt, n)
    finally:
        swap.restore()
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"what": a.what, "batch": a.batch, "prompt": a.prompt, "threads": a.threads, "dtype": a.dtype,
           "kernel_bindings_swapped": len(swap.points), "median_ms": med, "b_over_a": med["B"] / med["A"],
           "ms": times}  # fmt: skip
    print(f"{a.what} {a.batch} x {a.prompt}: A {med['A']:.2f} ms  B {med['B']:.2f} ms  B/A {res['b_over_a']:.3f} "
          f"({len(times['A'])} each, {len(swap.points)} bindings swapped)")  # fmt: skip
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
