"""Tokens/s with and without n-gram speculation on a copy-heavy workload.

The workload is summaries that quote their prompt (the case prompt lookup is
for). One model is loaded once; two shard runners share it, one with
--speculate K (n-gram) and one without, each driven in-process by the BlockRouter
harness (bench/block_router.py: room for K proposals per decode entry, advance by
the tokens returned). Greedy decoding, so both produce the same tokens. Batch 1 and
batch 16, side by side; prints a table, writes JSON (and a PNG when
matplotlib is installed).

    python benchmarks/speculative.py [--model DIR] [--speculate 4] [--max-new-tokens 96] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.models.default_model import resolve_model  # noqa: E402
from pagemill.models.loader import load_model  # noqa: E402
from pagemill.proto import pb  # noqa: E402
from pagemill.shard.model_runner import ModelRunner  # noqa: E402
from pagemill.bench.block_router import BlockRouter  # noqa: E402

BLOCK = 16
TEXTS = [
    "The city council voted on Tuesday to extend the tram line to the airport. The project will cost "
    "340 million euros and take four years. Construction starts in March. The mayor said the line "
    "would cut travel time to the airport from fifty minutes to twenty-five.",
    "Our quarterly revenue grew by 12 percent to 4.2 billion dollars, driven by cloud services. "
    "Operating margin fell to 18 percent because of higher energy costs. We expect revenue growth "
    "between 9 and 11 percent next quarter.",
    "To reset the router, hold the power button for ten seconds until the light blinks orange. "
    "Then connect to the network called SETUP and open the address 192.168.1.1 in a browser. "
    "Enter the password printed on the label under the device.",
    "The patient is a 54-year-old man with a history of hypertension. He reports chest pain that "
    "started two hours ago and spreads to the left arm. Blood pressure is 150 over 95. An ECG "
    "shows no ST elevation.",
]


def prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = TEXTS[i % len(TEXTS)]
        chat = (f"<|im_start|>user\nSummarise the following text, quoting its key sentences word for word:\n\n"
                f"{text}<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
        out.append(tok.encode(chat, add_special_tokens=False).ids)
    return out


def generate(runner: ModelRunner, batch_prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], int]:
    """Runs one batch to completion; returns (tokens of each request, decode steps)."""
    router = BlockRouter.for_runner(runner)
    for rid, p in enumerate(batch_prompts):
        router.add(rid, p, max_new)
    router.step()  # the prompts
    steps = 0
    while router.requests:
        router.step()
        steps += 1
    return [router.outputs[rid].ids for rid in range(len(batch_prompts))], steps


def measure(runner: ModelRunner, all_prompts, batch: int, max_new: int, repeats: int) -> dict:
    generate(runner, all_prompts[:batch], 4)  # warm the caches of this shape
    outputs, steps = [], 0
    start = time.perf_counter()
    for i in range(repeats):
        chunk = [all_prompts[(i * batch + j) % len(all_prompts)] for j in range(batch)]
        t, s = generate(runner, chunk, max_new)
        outputs, steps = outputs + t, steps + s
    elapsed = time.perf_counter() - start
    tokens = sum(map(len, outputs))
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "decode_steps": steps,
            "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--repeats", type=int, default=2, help="batches per measurement")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default); 1 on a shared box")
    ap.add_argument("--out", default=_repo.results("speculative"))
    a = ap.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    model_dir = str(resolve_model(a.model))
    model, config = load_model(model_dir, a.dtype, a.device)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    all_prompts = prompts(tok, 32)
    runners = {}
    for k in (0, a.speculate):
        runners[k] = ModelRunner(model, config, device=a.device, block_size=BLOCK, kv_cache_memory=256 << 20,
                                 model_dir=model_dir, speculate=k)  # fmt: skip
        runners[k].warmup(pb.WarmupRequest(max_batch_prefill_tokens=2048, max_input_tokens=512,
                                           max_total_tokens=1024, max_batch_size=16))  # fmt: skip
    rows = []
    for b in [int(x) for x in a.batch_sizes.split(",")]:
        base = measure(runners[0], all_prompts, b, a.max_new_tokens, a.repeats)
        spec = measure(runners[a.speculate], all_prompts, b, a.max_new_tokens, a.repeats)
        identical = base.pop("outputs") == spec.pop("outputs")  # greedy: speculation must not change a token
        rows.append({"batch": b, "baseline": base, "ngram": spec, "identical_tokens": identical,
                     "speedup": spec["tokens_per_s"] / base["tokens_per_s"]})
    print(f"model {Path(model_dir).name}, {a.device} {a.dtype}, speculate={a.speculate} (n-gram), "
          f"max_new_tokens={a.max_new_tokens}, greedy")
    print(f"{'batch':>5} | {'no spec tok/s':>13} | {'n-gram tok/s':>12} | {'speedup':>7} | {'decode steps':>13} | same")
    for r in rows:
        print(f"{r['batch']:>5} | {r['baseline']['tokens_per_s']:>13.1f} | {r['ngram']['tokens_per_s']:>12.1f} | "
              f"{r['speedup']:>6.2f}x | {r['baseline']['decode_steps']:>5} -> {r['ngram']['decode_steps']:<5} | "
              f"{r['identical_tokens']}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": Path(model_dir).name, "device": a.device, "dtype": a.dtype, "speculate": a.speculate,
            "max_new_tokens": a.max_new_tokens, "torch_threads": torch.get_num_threads(), "results": rows}
    (out / f"speculative_{a.device}.json" if a.device != "cpu" else out / "speculative.json").write_text(json.dumps(meta, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["baseline"]["tokens_per_s"] for r in rows], 0.4, label="no speculation")
    ax.bar([i + 0.2 for i in x], [r["ngram"]["tokens_per_s"] for r in rows], 0.4, label=f"n-gram, K={a.speculate}")
    ax.set_xticks(list(x), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{meta['model']} on {a.device}: copy-heavy summaries", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / (f"speculative_{a.device}.png" if a.device != "cpu" else "speculative.png"), dpi=120)


if __name__ == "__main__":
    main()
