"""Many LoRA adapters against the base model alone: output throughput at 64 concurrent.

    python benchmarks/lora.py --out benchmarks/results/lora

Two servers on the default model, both up at once (each idles while the other serves): the
base model alone (no `--enable-lora`), and `--enable-lora --max-loras 4` with 4 random rank-16
adapters in the model's shape (PEFT, every projection: q/k/v/o and gate/up/down, lora_B
nonzero). The same load against each: 64 streamed requests at once (distinct prompts,
`--new-tokens` greedy tokens each, EOS ignored), spread round-robin over the 4 adapters on the
second server. After a warm-up burst on each, `--runs` rounds, each a burst on the base server
and then the same burst on the LoRA one, so that each round's ratio is measured side by side
on a shared machine. Output throughput is generated tokens over the burst's wall time; the
figures are medians over the rounds, the ratio the median of the rounds' ratios.

Writes results.json and results.md, and appends one row to history.jsonl (date, commit, CPU
flags, figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.bench.history import append_history, git_commit  # noqa: E402
from pagemill.bench.serve import LaunchedServer  # noqa: E402
from pagemill.models.default_model import ensure_default_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The flags that pick the CPU kernels' paths (docs/cpu.md).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            have = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return []
    return [f for f in FLAGS if f in have]


def make_adapters(model_dir: str, out: str, n: int, rank: int) -> list[str]:
    """`n` random PEFT adapters of `rank` on every projection (lora_B drawn nonzero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = []
    for i in range(n):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.01)
        path = os.path.join(out, f"adapter{i}")
        peft_model.save_pretrained(path)
        dirs.append(path)
    return dirs


async def one(client: httpx.AsyncClient, url: str, prompt: str, n: int, adapter: str | None) -> tuple[float, int]:
    start = time.perf_counter()
    ttft, tokens = None, 0
    params = {"max_new_tokens": n, "ignore_eos_token": True}
    if adapter:
        params["adapter_id"] = adapter
    async with client.stream("POST", url + "/generate_stream", json={"inputs": prompt, "parameters": params}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if line.startswith("data:") and '"token"' in line:
                tokens += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
    return ttft or float("nan"), tokens


async def burst(url: str, concurrency: int, n: int, adapters: list[str], tag: str) -> dict:
    prompts = [f"Request {tag}-{i}: tell a story about the number {i * 7919 % 1000}." for i in range(concurrency)]
    pick = [adapters[i % len(adapters)] if adapters else None for i in range(concurrency)]
    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=concurrency)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, p, n, a) for p, a in zip(prompts, pick)))
        wall = time.perf_counter() - start
    ttfts = sorted(t for t, _ in results)
    tokens = sum(k for _, k in results)
    return {"output_tok_s": round(tokens / wall, 2), "tokens": tokens, "wall_s": round(wall, 3),
            "ttft_p50_s": round(statistics.median(ttfts), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the default model)")
    ap.add_argument("--out", default=_repo.results("lora"))
    ap.add_argument("--port", type=int, default=9460)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5, help="rounds of a burst on each server")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = a.model or str(ensure_default_model())
    work = tempfile.mkdtemp(prefix="lora-bench-")
    dirs = make_adapters(model, work, a.adapters, a.rank)
    names = [f"adapter{i}" for i in range(a.adapters)]
    common = ["--model", model, "--max-concurrent-requests", "128", "--max-input-tokens", "1024",
              "--max-total-tokens", "2048"]
    lora = ["--enable-lora", "--max-loras", str(a.adapters), "--max-lora-rank", str(a.rank),
            "--lora-modules", *[f"{n}={d}" for n, d in zip(names, dirs)]]
    rounds: list[dict] = []
    with contextlib.ExitStack() as stack:
        servers = {label: stack.enter_context(LaunchedServer(port, [*common, *extra], os.path.join(work, f"{label}.log")))
                   for label, port, extra in (("base", a.port, []), ("lora", a.port + 1, lora))}  # fmt: skip
        use = {"base": [], "lora": names}
        for label, s in servers.items():
            asyncio.run(burst(s.base_url, 8, 4, use[label], "warm"))
        for i in range(a.runs):
            rounds.append({label: asyncio.run(burst(s.base_url, a.concurrency, a.new_tokens, use[label], f"{label}{i}"))
                           for label, s in servers.items()})  # fmt: skip
            print(f"round {i + 1}: base {rounds[-1]['base']['output_tok_s']:.1f}, "
                  f"lora {rounds[-1]['lora']['output_tok_s']:.1f} tok/s", flush=True)
    runs = {label: {key: statistics.median(r[label][key] for r in rounds) for key in rounds[0][label]}
            for label in ("base", "lora")}  # fmt: skip
    ratio = round(statistics.median(r["lora"]["output_tok_s"] / r["base"]["output_tok_s"] for r in rounds), 3)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    result = {"date": now, "commit": git_commit(), "cpu_flags": cpu_flags(), "cpus": os.cpu_count(),
              "model": os.path.basename(model.rstrip("/")), "concurrency": a.concurrency, "new_tokens": a.new_tokens,
              "adapters": a.adapters, "rank": a.rank, "targets": TARGETS, "runs": runs, "lora_over_base": ratio,
              "rounds": [{label: r[label]["output_tok_s"] for label in r} for r in rounds]}
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
    md = [f"# LoRA: {a.adapters} rank-{a.rank} adapters against the base model, c={a.concurrency}", "",
          f"{now}, commit `{result['commit']}`, {os.cpu_count()} CPUs, flags: {', '.join(result['cpu_flags'])}; "
          f"model {result['model']}; {a.concurrency} streamed requests x {a.new_tokens} greedy tokens; medians of "
          f"{a.runs} rounds (a burst on each server).", "",
          "| server | output tok/s | TTFT p50 s | wall s |", "| --- | --- | --- | --- |"]
    for label, r in runs.items():
        md.append(f"| {label} | {r['output_tok_s']:.1f} | {r['ttft_p50_s']:.3f} | {r['wall_s']:.2f} |")
    per_round = ", ".join(f"{r['lora']['output_tok_s'] / r['base']['output_tok_s']:.2f}" for r in rounds)
    md += ["", f"LoRA / base: **{ratio:.2f}x** (median of the rounds' ratios: {per_round})", ""]
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write("\n".join(md))
    append_history(a.out, {"date": now, "commit": result["commit"], "cpu_flags": result["cpu_flags"],
                           "base_output_tok_s": runs["base"]["output_tok_s"],
                           "lora_output_tok_s": runs["lora"]["output_tok_s"], "lora_over_base": ratio})
    print("\n".join(md))


if __name__ == "__main__":
    main()
