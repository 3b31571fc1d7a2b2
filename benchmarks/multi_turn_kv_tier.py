"""Multi-turn chat against OpenAI-compatible servers: many users, each turn extends its
conversation (the previous prompt, the answer, a new question), so every turn's prompt
starts with the last one. With a KV pool smaller than the working set, earlier turns are
evicted between a user's turns: a second KV tier loads them back, a plain prefix cache
recomputes them.

Start the servers yourself (this script starts nothing), e.g. pagemill with and without
the tier, and any peer (vLLM-CPU with prefix caching) on the same model, then:

    python benchmarks/multi_turn_kv_tier.py --target tier=http://127.0.0.1:9301 \\
        --target no-tier=http://127.0.0.1:9302 --model SmolLM2-135M-Instruct --out benchmarks/results/multi-turn-kv-tier/run

Per target: prompt tokens computed (pagemill's /metrics, or vLLM's prompt tokens less
its prefix-cache hits; else "-"), TTFT p50/p99 (streamed /v1/completions, first chunk with text), output tokens/s
over the whole run. Targets run one after another, each on the same conversations.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import time

import httpx

import _repo  # noqa: E402,F401  (the repository from this file's path)

QUESTION = "\nUser: In one sentence, what should the depot do about parcel {n} in aisle {a}?\nAssistant:"


def document(user: int, words: int) -> str:
    """A distinct opening per user (so conversations share no prefix), `words` words long."""
    body = " ".join(f"clause{(user * 131 + i * 17) % 997} applies to shipment {i} of customer {user}."
                    for i in range(words // 8))
    return f"Conversation {user}. Logistics handbook excerpt: {body}"


def metric(client: httpx.Client, url: str, name: str) -> float | None:
    """A counter's value, summed over its label sets (vLLM labels by model)."""
    try:
        text = client.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(None, 1)[1]) for line in text.splitlines()
              if line.startswith(name + " ") or line.startswith(name + "{")]
    return sum(values) if values else None


def computed_tokens(client: httpx.Client, url: str) -> float | None:
    """Prompt tokens the server computed so far: pagemill's counter, or vLLM's
    prompt tokens less its prefix-cache hits."""
    ours = metric(client, url, "pagemill_prefill_tokens_total")
    if ours is not None:
        return ours
    prompt, hits = metric(client, url, "vllm:prompt_tokens_total"), metric(client, url, "vllm:prefix_cache_hits_total")
    return None if prompt is None or hits is None else prompt - hits


def turn(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, str, int]:
    """(TTFT seconds, generated text, output tokens) of one streamed greedy completion."""
    start, ttft, text, chunks = time.perf_counter(), None, [], 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            piece = json.loads(line[5:])["choices"][0].get("text", "")
            if piece and ttft is None:
                ttft = time.perf_counter() - start
            text.append(piece)
            chunks += 1
    return (ttft if ttft is not None else time.perf_counter() - start), "".join(text), chunks


def run_target(url: str, model: str, users: int, turns: int, doc_words: int, max_tokens: int) -> dict:
    client = httpx.Client()
    computed0 = computed_tokens(client, url)
    loaded0 = metric(client, url, "pagemill_kv_tier_loaded_blocks_total")

    def user(u: int) -> tuple[list[float], int]:
        history, ttfts, out = document(u, doc_words), [], 0
        with httpx.Client() as c:
            for t in range(turns):
                history += QUESTION.format(n=u * 100 + t, a=t % 9)
                ttft, text, n = turn(c, url, model, history, max_tokens)
                ttfts.append(ttft)
                out += n
                history += text
        return ttfts, out

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(users) as pool:
        results = list(pool.map(user, range(users)))
    wall = time.perf_counter() - start
    ttfts = sorted(x for r in results for x in r[0])
    computed1 = computed_tokens(client, url)
    loaded1 = metric(client, url, "pagemill_kv_tier_loaded_blocks_total")
    q = statistics.quantiles(ttfts, n=100, method="inclusive") if len(ttfts) > 1 else ttfts * 99
    return {
        "url": url, "requests": len(ttfts), "wall_s": wall,
        "prompt_tokens_computed": None if computed0 is None else computed1 - computed0,
        "tier_blocks_loaded": None if loaded0 is None else loaded1 - loaded0,
        "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": q[98],
        "output_tokens_per_s": sum(r[1] for r in results) / wall,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", required=True, help="name=URL of an OpenAI-compatible server")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name sent in requests")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--doc-words", type=int, default=400, help="opening document per user, in words")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="write <out>.json")
    a = ap.parse_args()
    rows = {}
    for t in a.target:
        name, url = t.split("=", 1)
        rows[name] = run_target(url.rstrip("/"), a.model, a.users, a.turns, a.doc_words, a.max_tokens)
    fmt = "{:<14} {:>9} {:>9} {:>10} {:>10} {:>10}"
    print(fmt.format("target", "computed", "loaded", "TTFT p50", "TTFT p99", "out tok/s"))
    for name, r in rows.items():
        print(fmt.format(name, "-" if r["prompt_tokens_computed"] is None else f"{r['prompt_tokens_computed']:.0f}",
                         "-" if r["tier_blocks_loaded"] is None else f"{r['tier_blocks_loaded']:.0f}",
                         f"{r['ttft_p50_s'] * 1e3:.0f} ms", f"{r['ttft_p99_s'] * 1e3:.0f} ms",
                         f"{r['output_tokens_per_s']:.1f}"))  # fmt: skip
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".json", "w") as f:
            json.dump({"config": vars(a), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
