"""KV-cache benchmark: steady-state utilization, concurrency versus up-front
reservation, and what cache-aware admission buys.

    python benchmarks/kv_cache.py --out benchmarks/results/kv-cache

Part 1 (utilization). N streamed requests arrive at once; each has
max_new_tokens=512 but really ends after L ~ U(16, 512) tokens, which the
server cannot know in advance (as with EOS). The client ends the request by
closing the stream after L tokens. /metrics is sampled throughout; steady
state is every sample with requests still queued (the pool, not the arrivals,
limits the batch). TGI-style admission, which reserves prompt + max_new_tokens
slots per sequence, is simulated on the same requests and the same pool, one
token per step for every running sequence.

Part 2 (cache-aware admission). G system prompts, interleaved requests, a pool
too small to keep every prefix cached: FIFO versus --cache-aware-admission,
compared on prompt tokens computed, prefix hits and wall time.

Both parts use a random-weight tiny Llama (the default model's tokenizer), so
the run takes minutes on a CPU and the figures are about block accounting,
not model speed. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import httpx

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.bench.datasets import PromptMaker  # noqa: E402
from pagemill.bench.serve import LaunchedServer  # noqa: E402
from pagemill.bench.server_probe import info, scrape  # noqa: E402
from pagemill.models.default_model import ensure_default_model  # noqa: E402

MAX_NEW = 512


def tiny_model(out: str, tokenizer_dir: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out, name))
    return out


# ---------------------------------------------------------------- part 1


async def stream_until(client: httpx.AsyncClient, url: str, prompt: str, stop_after: int) -> int:
    """Streams one request and hangs up after `stop_after` tokens; returns tokens seen."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW, "ignore_eos_token": True}}
    seen = 0
    async with client.stream("POST", url + "/generate_stream", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data:") and '"token"' in line:
                seen += 1
                if seen >= stop_after:
                    break
    return seen


async def sample_metrics(url: str, every_s: float, out: list[dict], done: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        while not done.is_set():
            text = (await c.get(url + "/metrics")).text
            row = {"t": time.monotonic()}
            for line in text.splitlines():
                if line.startswith("pagemill_") and "{" not in line:
                    name, _, v = line.rpartition(" ")
                    row[name] = float(v)
            out.append(row)
            try:
                await asyncio.wait_for(done.wait(), every_s)
            except asyncio.TimeoutError:
                pass


async def utilization_run(url: str, prompts: list[str], lengths: list[int]) -> dict:
    samples: list[dict] = []
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=0)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=3600, limits=limits) as c:
        sampler = asyncio.create_task(sample_metrics(url, 0.25, samples, done))
        got = await asyncio.gather(*(stream_until(c, url, p, n) for p, n in zip(prompts, lengths)))
        done.set()
        await sampler
    wall = time.monotonic() - t0
    short = sum(g < n for g, n in zip(got, lengths))
    steady = [s for s in samples if s.get("pagemill_queue_size", 0) > 0 and s.get("pagemill_batch_size", 0) > 0]
    steady = steady[len(steady) // 10:]  # the first tenth is ramp-up
    if not steady:
        raise SystemExit("no steady state (the queue never backed up): raise --requests or shrink --kv-memory")
    util = [s["pagemill_kv_utilization"] for s in steady]
    batch = [s["pagemill_batch_size"] for s in steady]
    used = [s["pagemill_kv_blocks_used"] / s["pagemill_kv_blocks_total"] for s in steady]
    return {"wall_s": wall, "requests_cut_short": short, "samples": len(samples), "steady_samples": len(steady),
            "utilization_median": statistics.median(util), "utilization_mean": statistics.fmean(util),
            "utilization_p5": sorted(util)[len(util) // 20],
            "batch_mean": statistics.fmean(batch), "batch_max": max(batch),
            "blocks_used_frac_median": statistics.median(used),
            "series": [{"t": s["t"] - t0, "util": s.get("pagemill_kv_utilization", 0.0),
                        "batch": s.get("pagemill_batch_size", 0.0), "queue": s.get("pagemill_queue_size", 0.0)}
                       for s in samples]}


def simulate_reservation(prompt_lens: list[int], lengths: list[int], num_blocks: int, block_size: int) -> dict:
    """TGI-style admission on the same requests: each sequence holds
    ceil((prompt + max_new_tokens) / block_size) blocks from admission to end;
    FIFO; one token per step per running sequence."""
    need = [math.ceil((p + MAX_NEW) / block_size) for p in prompt_lens]
    queue, running, free, steps = list(range(len(lengths))), {}, num_blocks, 0
    conc, util = [], []
    while queue or running:
        while queue and need[queue[0]] <= free:
            i = queue.pop(0)
            free -= need[i]
            running[i] = 0
        for i in list(running):
            running[i] += 1
            if running[i] >= lengths[i]:
                del running[i]
                free += need[i]
        steps += 1
        if queue:
            conc.append(len(running))
            held = (num_blocks - free) * block_size
            real = sum(prompt_lens[i] + g for i, g in running.items())
            util.append(real / held if held else 0.0)
    return {"steps": steps, "batch_mean": statistics.fmean(conc), "batch_max": max(conc),
            "utilization_median": statistics.median(util)}


def part1(a, model_dir: str, tok) -> dict:
    rng = random.Random(a.seed)
    maker = PromptMaker(tok, rng)
    prompts, plens = [], []
    for _ in range(a.requests):
        text, n = maker.text(rng.randint(a.prompt_min, a.prompt_max))
        prompts.append(text)
        plens.append(n)  # the tokenizer adds no BOS
    lengths = [rng.randint(16, MAX_NEW) for _ in range(a.requests)]
    args = ["--model", model_dir, "--kv-cache-memory", a.kv_memory, "--max-input-tokens", "512",
            "--max-total-tokens", "1024", "--max-concurrent-requests", str(a.requests + 8),
            "--max-batch-size", "512", "--num-threads", "1"]
    runs = []
    for r in range(a.repeats):
        with LaunchedServer(a.port, args, os.path.join(a.out, f"server-util-{r}.log")) as s:
            inf = info(s.base_url)
            before = scrape(s.base_url)
            res = asyncio.run(utilization_run(s.base_url, prompts, lengths))
            after = scrape(s.base_url)
            res["preemptions"] = after["pagemill_preemptions_total"] - before["pagemill_preemptions_total"]
            res["decode_steps"] = after["pagemill_decode_steps_total"] - before["pagemill_decode_steps_total"]
            res["blocks_free_at_end"] = after["pagemill_kv_blocks_free"]
            # Prompt tokens computed beyond each prompt once: the recompute preemption cost.
            res["recomputed_tokens"] = (after["pagemill_prefill_tokens_total"] - before["pagemill_prefill_tokens_total"]
                                        - (after["pagemill_prompt_tokens_total"] - before["pagemill_prompt_tokens_total"]))
            # The router's own count (net of prefix-cache hits on resume).
            res["recomputed_tokens_metric"] = (after.get("pagemill_recomputed_tokens_total", 0)
                                               - before.get("pagemill_recomputed_tokens_total", 0))
            res["generated_tokens"] = (after["pagemill_generated_tokens_total"]
                                       - before["pagemill_generated_tokens_total"])
        res["num_blocks"], res["block_size"] = inf["kv_blocks_total"], inf["block_size"]
        runs.append(res)
        print(f"  run {r}: utilization median {res['utilization_median']:.4f}, mean batch {res['batch_mean']:.1f}, "
              f"{res['preemptions']:.0f} preemptions, {res['recomputed_tokens']:.0f} recomputed "
              f"({res['recomputed_tokens_metric']:.0f} by the metric), {res['decode_steps']:.0f} decode steps, "
              f"{res['wall_s']:.1f} s", flush=True)
    nb, bs = runs[0]["num_blocks"], runs[0]["block_size"]
    tgi = simulate_reservation(plens, lengths, nb, bs)
    reserve_blocks = math.ceil((statistics.fmean(plens) + MAX_NEW) / bs)
    return {"requests": a.requests, "prompt_len_mean": statistics.fmean(plens),
            "output_len_mean": statistics.fmean(lengths), "max_new_tokens": MAX_NEW,
            "num_blocks": nb, "block_size": bs, "runs": runs, "reservation": tgi,
            "reservation_analytic_max": nb // reserve_blocks}


# ---------------------------------------------------------------- part 2


async def fire_all(url: str, prompts: list[str], out_len: int) -> list[float]:
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as c:
        async def one(p: str) -> float:
            t = time.monotonic()
            r = await c.post(url + "/generate", json={"inputs": p, "parameters": {
                "max_new_tokens": out_len, "ignore_eos_token": True, "decoder_input_details": False}})
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
            return time.monotonic() - t
        return await asyncio.gather(*(one(p) for p in prompts))


def part2(a, model_dir: str, tok) -> dict:
    rng = random.Random(a.seed + 1)
    maker = PromptMaker(tok, rng)
    prefixes = [maker.text(a.prefix_len)[0] for _ in range(a.groups)]
    order = [g for g in range(a.groups) for _ in range(a.prefix_requests // a.groups)]
    rng.shuffle(order)
    prompts = [prefixes[g] + "\n" + maker.text(32)[0] for g in order]
    base = ["--model", model_dir, "--kv-cache-memory", a.prefix_kv_memory, "--max-input-tokens", "1024",
            "--max-total-tokens", "1200", "--max-batch-prefill-tokens", str(a.prefix_len * 4),
            "--max-concurrent-requests", str(len(prompts) + 8), "--num-threads", "1"]
    configs = (("fifo", []), ("cache_aware", ["--cache-aware-admission"]))
    rows: dict[str, list[dict]] = {label: [] for label, _ in configs}
    for r in range(a.repeats):  # alternate the two, so machine noise hits both alike
        for label, extra in configs:
            with LaunchedServer(a.port, base + extra, os.path.join(a.out, f"server-{label}-{r}.log")) as s:
                nb = info(s.base_url)["kv_blocks_total"]
                before = scrape(s.base_url)
                t0 = time.monotonic()
                lat = asyncio.run(fire_all(s.base_url, prompts, a.prefix_output))
                wall = time.monotonic() - t0
                after = scrape(s.base_url)
            d = {k: after[k] - before[k] for k in ("pagemill_prefill_tokens_total", "pagemill_prompt_tokens_total",
                                                   "pagemill_prefix_hit_tokens_total", "pagemill_preemptions_total")}
            rows[label].append({"wall_s": wall, "latency_median_s": statistics.median(lat), "num_blocks": nb,
                                "prefill_tokens": d["pagemill_prefill_tokens_total"],
                                "prompt_tokens": d["pagemill_prompt_tokens_total"],
                                "prefix_hit_tokens": d["pagemill_prefix_hit_tokens_total"],
                                "preemptions": d["pagemill_preemptions_total"]})
            print(f"  {label} run {r}: {rows[label][-1]['prefill_tokens']:.0f} prompt tokens computed, "
                  f"{wall:.1f} s", flush=True)
    keys = ("wall_s", "latency_median_s", "prefill_tokens", "prefix_hit_tokens", "prompt_tokens", "preemptions")
    out = {label: {"runs": rs, **{k: statistics.median(x[k] for x in rs) for k in keys}} for label, rs in rows.items()}
    return {"model": a.admission_model, "groups": a.groups, "prefix_len": a.prefix_len, "requests": len(prompts),
            "output_len": a.prefix_output, **out}


# ---------------------------------------------------------------- report


def report(res: dict) -> str:
    lines = []
    p1 = res.get("utilization")
    med = lambda k: statistics.median(r[k] for r in p1["runs"])  # noqa: E731
    if p1 is None:
        return report_admission(res)
    ours_batch, tgi = med("batch_mean"), p1["reservation"]
    lines += [f"KV pool: {p1['num_blocks']} blocks x {p1['block_size']} tokens; {p1['requests']} requests, "
              f"prompt ~{p1['prompt_len_mean']:.0f}, output U(16,512) mean {p1['output_len_mean']:.0f}, "
              f"max_new_tokens {MAX_NEW}",
              "",
              "| | pagemill (measured) | TGI-style reservation (simulated) | ratio |",
              "| --- | ---: | ---: | ---: |",
              f"| KV utilization, steady state (median) | {med('utilization_median'):.2%} | "
              f"{tgi['utilization_median']:.2%} | |",
              f"| concurrent sequences, steady state (mean) | {ours_batch:.1f} | {tgi['batch_mean']:.1f} | "
              f"{ours_batch / tgi['batch_mean']:.2f}x |",
              f"| concurrent sequences (max) | {med('batch_max'):.0f} | {tgi['batch_max']} "
              f"(analytic {p1['reservation_analytic_max']}) | {med('batch_max') / tgi['batch_max']:.2f}x |",
              f"| decode steps for the workload | {med('decode_steps'):.0f} | {tgi['steps']} | "
              f"{tgi['steps'] / med('decode_steps'):.2f}x fewer |",
              f"| preemptions | {med('preemptions'):.0f} | 0 | |",
              f"| tokens recomputed after preemption | {med('recomputed_tokens'):.0f} "
              f"({med('recomputed_tokens') / med('generated_tokens'):.1%} of {med('generated_tokens'):.0f} generated) "
              "| 0 | |", ""]
    return "\n".join(lines) + "\n" + report_admission(res)


def report_admission(res: dict) -> str:
    lines = []
    if "admission" in res:
        p2 = res["admission"]
        f, c = p2["fifo"], p2["cache_aware"]
        lines += [f"Cache-aware admission ({p2['model']} model): {p2['groups']} system prompts of {p2['prefix_len']} tokens, "
                  f"{p2['requests']} interleaved requests, pool {f['runs'][0]['num_blocks']} blocks",
                  "",
                  "| | FIFO | cache-aware | ratio |", "| --- | ---: | ---: | ---: |",
                  f"| prompt tokens computed | {f['prefill_tokens']:.0f} | {c['prefill_tokens']:.0f} | "
                  f"{f['prefill_tokens'] / max(c['prefill_tokens'], 1):.2f}x fewer |",
                  f"| prefix-hit tokens | {f['prefix_hit_tokens']:.0f} | {c['prefix_hit_tokens']:.0f} | |",
                  f"| wall time (s) | {f['wall_s']:.1f} | {c['wall_s']:.1f} | {f['wall_s'] / c['wall_s']:.2f}x |",
                  f"| median latency (s) | {f['latency_median_s']:.2f} | {c['latency_median_s']:.2f} | |",
                  f"| preemptions | {f['preemptions']:.0f} | {c['preemptions']:.0f} | |"]
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = res["utilization"]["runs"][0]["series"]
    fig, ax = plt.subplots(figsize=(8, 4))
    t = [s["t"] for s in series]
    ax.plot(t, [s["util"] * 100 for s in series], label="KV utilization (%)")
    ax.plot(t, [s["batch"] for s in series], label="running sequences")
    ax.axhline(res["utilization"]["reservation"]["batch_mean"], ls="--", color="gray",
               label="TGI-style reservation: mean sequences")
    ax.set_xlabel("seconds")
    ax.legend(loc="lower right")
    ax.set_title("KV pool at steady state (outputs 16..512, max_new_tokens 512)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=_repo.results("kv-cache"))
    p.add_argument("--port", type=int, default=3917)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--kv-memory", default="8MiB", help="KV pool of part 1 (8MiB = 1024 blocks on the tiny model)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--prefix-requests", type=int, default=256)
    p.add_argument("--prefix-output", type=int, default=32)
    p.add_argument("--prefix-kv-memory", default="1536KiB", help="KV pool of part 2 (192 blocks on the tiny model)")
    p.add_argument("--parts", default="utilization,admission", help="which parts to run, comma-separated")
    p.add_argument("--admission-model", default="tiny", choices=["tiny", "default"],
                   help="part 2 on the tiny model (token counts) or SmolLM2 (where prefill time shows)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from tokenizers import Tokenizer

    default = str(ensure_default_model())
    tok = Tokenizer.from_file(os.path.join(default, "tokenizer.json"))
    with tempfile.TemporaryDirectory() as tmp:
        model, parts, res = tiny_model(tmp, default), a.parts.split(","), {}
        if "utilization" in parts:
            print("part 1: utilization and concurrency", flush=True)
            res["utilization"] = part1(a, model, tok)
        if "admission" in parts:
            print("part 2: cache-aware admission", flush=True)
            res["admission"] = part2(a, model if a.admission_model == "tiny" else default, tok)
    table = report(res)
    print(table)
    with open(os.path.join(a.out, "kv_cache.json"), "w") as f:
        json.dump({"args": vars(a), **res}, f, indent=1)
    with open(os.path.join(a.out, "kv_cache.md"), "w") as f:
        f.write(table + "\n")
    if "utilization" in res:
        plot(res, os.path.join(a.out, "kv_cache.png"))


if __name__ == "__main__":
    main()
