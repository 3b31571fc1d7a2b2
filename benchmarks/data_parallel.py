"""Data-parallel shard groups: throughput and TTFT at 64 concurrent with 1 vs 2
groups, and prompt tokens computed per routing policy on a shared-prefix
workload.

    python benchmarks/data_parallel.py --out benchmarks/results/data-parallel

Part 1: 64 streamed requests at once (distinct prompts, 64 greedy tokens each,
ignore EOS) against `--data-parallel 1` and `2` on the same model; median of
`--repeats` rounds per setting, the settings interleaved round by round. On a
machine with a few cores the groups share them, so this measures the
overhead of the extra group, not a speed-up.

Part 2: 8 system prompts (~650 tokens) x 4 questions, one request at a time
(so that what is computed depends only on placement, not timing), against
`--data-parallel 2` with each `--routing`; prompt tokens computed from
/metrics (`pagemill_prefill_tokens_total`).

The default model is a random-weight tiny Llama with the default model's
tokenizer (benchmarks/kv_cache.py): the figures are about scheduling and
placement, not model speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kv_cache import tiny_model  # noqa: E402

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.bench.serve import LaunchedServer  # noqa: E402
from pagemill.models.default_model import ensure_default_model  # noqa: E402

SYSTEMS = [f"You are assistant number {i}. " + " ".join(f"rule{i}-{k} applies." for k in range(90)) for i in range(8)]
QUESTIONS = ["What is the first rule?", "Summarise the rules.", "Which rule matters most?", "Say hello."]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


async def one(client: httpx.AsyncClient, url: str, prompt: str, n: int) -> tuple[float, int]:
    start = time.perf_counter()
    ttft, tokens = None, 0
    body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "ignore_eos_token": True}}
    async with client.stream("POST", url + "/generate_stream", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:") and '"token"' in line:
                tokens += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
    return ttft or float("nan"), tokens


async def burst(url: str, concurrency: int, n: int, round_: int) -> dict:
    prompts = [f"Request {round_}-{i}: tell a story about the number {i * 7919 % 1000}." for i in range(concurrency)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, p, n) for p in prompts))
        wall = time.perf_counter() - start
    ttfts = sorted(t for t, _ in results)
    tokens = sum(k for _, k in results)
    return {"tokens_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: a random-weight tiny Llama)")
    ap.add_argument("--out", default=_repo.results("data-parallel"))
    ap.add_argument("--port", type=int, default=9450)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = a.model or tiny_model(tempfile.mkdtemp(prefix="dp-tiny-"), str(ensure_default_model()))
    common = ["--model", model, "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-concurrent-requests", "128",
              "--max-input-tokens", "1024", "--max-total-tokens", "2048"]
    rounds: dict[int, list[dict]] = {1: [], 2: []}
    for r in range(a.repeats):
        for dp in (1, 2):  # interleaved: drift of the shared machine hits both settings alike
            with LaunchedServer(a.port, [*common, "--data-parallel", str(dp)], os.path.join(a.out, f"dp{dp}.log")) as s:
                asyncio.run(burst(s.base_url, 8, 4, -1))  # warm-up
                rounds[dp].append(asyncio.run(burst(s.base_url, a.concurrency, a.new_tokens, r)))
    part1 = {dp: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for dp, rs in rounds.items()}
    part2 = {}
    for routing in ("prefix", "least-load", "round-robin"):
        args = [*common, "--data-parallel", "2", "--routing", routing]
        with LaunchedServer(a.port, args, os.path.join(a.out, f"{routing}.log")) as s:
            before = metric(s.base_url, "pagemill_prefill_tokens_total")
            for system in SYSTEMS:
                for q in QUESTIONS:
                    httpx.post(s.base_url + "/generate", timeout=120, json={
                        "inputs": f"{system}\nQuestion: {q}\nAnswer:", "parameters": {"max_new_tokens": 4}})
            part2[routing] = metric(s.base_url, "pagemill_prefill_tokens_total") - before
    print(f"\n{a.concurrency} concurrent x {a.new_tokens} tokens, median of {a.repeats} (cores: {os.cpu_count()})")
    print(f"{'groups':>6} {'tok/s':>9} {'TTFT p50 s':>11} {'TTFT p99 s':>11}")
    for dp, m in part1.items():
        print(f"{dp:>6} {m['tokens_per_s']:>9.1f} {m['ttft_p50_s']:>11.3f} {m['ttft_p99_s']:>11.3f}")
    print(f"\nprompt tokens computed, 8 system prompts x 4 questions, 2 groups")
    for routing, t in part2.items():
        print(f"{routing:>12} {t:>8.0f}  ({t / part2['prefix']:.2f}x prefix)")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"concurrency": a.concurrency, "new_tokens": a.new_tokens, "repeats": a.repeats,
                   "cpu_count": os.cpu_count(), "throughput_ttft": part1, "rounds": rounds,
                   "prompt_tokens_computed": part2}, f, indent=2)


if __name__ == "__main__":
    main()
