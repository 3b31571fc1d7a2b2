"""Two pagemill builds side by side on `bench compare`'s c=64 workload, bursts alternating.

    python benchmarks/paired_burst.py --a /path/to/tree-a --b /path/to/tree-b --rounds 8 \
        --a-args "--no-schedule-ahead" --a-env GOMP_SPINCOUNT=20000 --json benchmarks/results/paired-burst/pairs.json

Why: one `bench compare` run of a server varies by +-5% on a shared 2-core machine, more
than most single changes are worth. Here both servers (each `python -m pagemill launch`
from its tree's `server/` directory, bf16, as `bench compare` starts it) stay up, idle but for
their own burst, and the bursts alternate A, B, B, A, ...: 64 requests at once (--num-prompts:
more, 64 at a time, each sent as one ends), prompts 32-256 tokens, outputs 16-256 (ignore EOS),
a new seed each round (so no prefix is cached), the same seed for both servers of a round.
Prints each pair's tok/s and their ratio, and the medians, including the mean forward and
step time from the router's counters (their difference: the time between two forwards).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import types
from contextlib import ExitStack

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.bench import peer_configs
from pagemill.bench.compare import PeerServer
from pagemill.bench.peer_configs import ServerConfig

PORTS = {"a": 8077, "b": 8078}


def server(tree: str, extra: str, env: list[str]) -> ServerConfig:
    """bench compare's pagemill preset (bf16), run from `tree`'s sources; env: KEY=VALUE items
    added to its environment (the shards inherit it)."""
    config = peer_configs.pagemill(os.path.basename(os.path.abspath(tree)), "bf16", f"--dtype bfloat16 {extra}")
    config.env["PYTHONPATH"] = os.path.join(os.path.abspath(tree), "server")
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--a-env/--b-env takes KEY=VALUE, got {item!r}")
        config.env[key] = value
    return config


def burst(port: int, seed: int, tok, warm_first: bool, num_prompts: int = 64) -> dict:
    from pagemill.bench.compare import MODEL_NAME, _counters, _step_accounting, measure, workload_requests
    from pagemill.bench.load import LoadConfig, run_load, warm

    a = types.SimpleNamespace(num_prompts=num_prompts, input_min=32, input_max=256, output_min=16, output_max=256,
                              seed=seed, batch1_prompts=4, batch1_input_len=64, batch1_output_len=128,
                              concurrency=64)  # fmt: skip
    main, _, w = workload_requests(a, tok)
    cfg = LoadConfig(base_url=f"http://127.0.0.1:{port}", endpoint="openai", model=MODEL_NAME, max_concurrency=64,
                     seed=seed, progress=False, keepalive=False)  # fmt: skip
    if warm_first:
        asyncio.run(warm(cfg, w[0], n=2))
        asyncio.run(run_load(w, cfg, desc="warm-up"))
    before = _counters(cfg.base_url)
    records, duration = asyncio.run(run_load(main, cfg, desc="burst"))
    metrics, check = measure(records, main, duration)
    return {"seed": seed, "tok_s": metrics["output_throughput"], "ttft_p99_ms": metrics["ttft"]["percentiles_ms"]["p99"],
            "tokens_ok": check.ok, "steps": _step_accounting(before, _counters(cfg.base_url))}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="tree A (its server/ is put on PYTHONPATH)")
    p.add_argument("--b", required=True, help="tree B")
    p.add_argument("--a-args", default="", help="extra `pagemill launch` flags for A")
    p.add_argument("--b-args", default="")
    p.add_argument("--a-env", action="append", default=[], help="KEY=VALUE in A's environment (repeat)")
    p.add_argument("--b-env", action="append", default=[])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=64,
                   help="requests per burst, 64 at a time (more: a steady stream of arrivals after the first 64)")
    p.add_argument("--json")
    a = p.parse_args()
    from tokenizers import Tokenizer

    from pagemill.bench.cli import resolve_model_dir

    model_dir = resolve_model_dir(None)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    with ExitStack() as stack:
        for k in PORTS:  # each started, ready and warmed up (not counted) before the next
            values = {"python": sys.executable, "port": str(PORTS[k]), "model_dir": model_dir}
            stack.enter_context(PeerServer(server(getattr(a, k), getattr(a, f"{k}_args"), getattr(a, f"{k}_env")), values,
                                           f"/tmp/paired_burst_{k}.log", timeout_s=300))  # fmt: skip
            burst(PORTS[k], 0, tok, warm_first=True)
        for r in range(1, a.rounds + 1):
            for k in ("a", "b") if r % 2 else ("b", "a"):
                runs[k].append(burst(PORTS[k], 100 + r, tok, warm_first=False, num_prompts=a.num_prompts))
            ra, rb = runs["a"][-1]["tok_s"], runs["b"][-1]["tok_s"]
            print(f"round {r}: A {ra:.1f}  B {rb:.1f} tok/s  A/B {ra / rb:.3f}", flush=True)

    def med(k: str, f) -> float:
        return statistics.median(f(x) for x in runs[k])

    ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(runs["a"], runs["b"])]
    print("| build | tok/s median | forward ms | step ms | TTFT p99 ms |\n| --- | ---: | ---: | ---: | ---: |")
    for k in PORTS:
        print(f"| {k.upper()} | {med(k, lambda x: x['tok_s']):.1f} | {med(k, lambda x: x['steps']['mean_forward_ms']):.2f} | "
              f"{med(k, lambda x: x['steps']['mean_step_ms']):.2f} | {med(k, lambda x: x['ttft_p99_ms']):.0f} |")  # fmt: skip
    print(f"pair ratios A/B: {' '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f}")
    if not all(x["tokens_ok"] for k in PORTS for x in runs[k]):
        print("warning: some burst got fewer tokens than it asked for")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs, "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
