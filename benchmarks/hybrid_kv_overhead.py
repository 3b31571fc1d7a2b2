"""What the local (sliding-window) layers of a hybrid model hold beyond their window, measured.

pagemill keeps one block table for all layers, so a Gemma 2/3 local layer keeps every token's
K/V although it reads only its window. This launches a tiny Gemma 3 (2 local layers with an
8-token window, 1 global layer; 4-token blocks) through `pagemill launch`, runs one long
greedy request, and reads /metrics while it runs: `pagemill_kv_blocks_used` and, in the same
read, `pagemill_generated_tokens_total` (how long the sequence is at that moment). The
blocks a local layer needs are those its window touches (ceil(W / block) + 1); the rest of what
the sequence holds is what the local layers keep beyond the window. Bytes per block and layer
come from the shard's own pool sizing (KVPool.bytes_per_block). The same per-block accounting
is then applied to the published Gemma 3 1B and Gemma 2 9B configurations (config only, no
weights). Prints a table and writes JSON.

    python benchmarks/hybrid_kv_overhead.py [--out benchmarks/results/hybrid-kv-overhead/results.json] [--port 9510]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration-tests"))
from windowed_models import build  # noqa: E402

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.models.config import ModelConfig  # noqa: E402
from pagemill.shard.kv_pool import KVPool  # noqa: E402

BLOCK, WINDOW, LAYERS, LOCAL = 4, 8, 3, 2
CHECKPOINTS = (64, 128, 256, 400)  # sequence lengths reported (nearest /metrics read)
MAX_NEW = 460
PROMPT_WORDS = 16


def scrape(url: str) -> dict[str, float]:
    """The unlabelled series of one /metrics read."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            out[parts[0]] = float(parts[1])
    return out


def measure_tiny(port: int, default_model: Path) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="hybrid-kv-"))
    model = build(tmp / "gemma3", default_model, "Gemma3TextConfig", num_hidden_layers=LAYERS, head_dim=16,
                  query_pre_attn_scalar=24, sliding_window=WINDOW,
                  layer_types=["sliding_attention"] * LOCAL + ["full_attention"])  # fmt: skip
    argv = [sys.executable, "-m", "pagemill", "launch", "--model", str(model), "--port", str(port),
            "--master-port", str(port + 1), "--dtype", "float32", "--block-size", str(BLOCK),
            "--max-input-tokens", "256", "--max-total-tokens", "512"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("server did not start")
            time.sleep(0.5)
        prompt_tokens = len(httpx.post(f"{url}/tokenize", json={"inputs": " ".join(["word"] * PROMPT_WORDS)},
                                       timeout=10).json())  # fmt: skip
        body = {"inputs": " ".join(["word"] * PROMPT_WORDS),
                "parameters": {"max_new_tokens": MAX_NEW, "ignore_eos": True}}
        generated_before = scrape(url)["pagemill_generated_tokens_total"]
        done = threading.Event()

        def run() -> None:
            httpx.post(f"{url}/generate", json=body, timeout=600)
            done.set()

        threading.Thread(target=run, daemon=True).start()
        # One scrape gives both the request's progress and the blocks it holds at that moment.
        samples = []
        while not done.is_set():
            m = scrape(url)
            generated = m["pagemill_generated_tokens_total"] - generated_before
            if 0 < generated < MAX_NEW:
                samples.append({"tokens": int(prompt_tokens + generated), "blocks_used": int(m["pagemill_kv_blocks_used"]),
                                "released": int(m["pagemill_kv_window_released_blocks_total"])})
            time.sleep(0.02)
        rows = [min(samples, key=lambda r: abs(r["tokens"] - t)) for t in CHECKPOINTS]
        cfg = ModelConfig.from_dict(json.loads((model / "config.json").read_text()))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    per_layer_block = KVPool.bytes_per_block(cfg, BLOCK, torch.float32) // cfg.num_hidden_layers
    window_blocks = math.ceil(WINDOW / BLOCK) + 1
    for row in rows:
        row["beyond_window_blocks_per_local_layer"] = row["blocks_used"] - window_blocks
        row["beyond_window_bytes"] = int(LOCAL * row["beyond_window_blocks_per_local_layer"] * per_layer_block)
        row["all_bytes"] = int(row["blocks_used"] * per_layer_block * cfg.num_hidden_layers)
    return {"config": {"layers": LAYERS, "local_layers": LOCAL, "window": WINDOW, "block_size": BLOCK,
                       "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "dtype": "float32",
                       "bytes_per_block_and_layer": per_layer_block}, "rows": rows}


def published(name: str, layers: int, local: int, kv_heads: int, head_dim: int, window: int, context: int) -> dict:
    """One sequence at full context, bf16, 16-token blocks: held by local layers beyond the window."""
    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 256, "hidden_size": kv_heads * head_dim,
                                 "intermediate_size": 8, "num_hidden_layers": layers, "num_attention_heads": kv_heads,
                                 "num_key_value_heads": kv_heads, "head_dim": head_dim})  # fmt: skip
    per_layer_block = KVPool.bytes_per_block(cfg, 16, torch.bfloat16) // layers
    blocks = math.ceil(context / 16)
    beyond = blocks - (math.ceil(window / 16) + 1)
    return {"model": name, "context": context, "layers": layers, "local_layers": local, "window": window,
            "held_bytes": blocks * per_layer_block * layers, "beyond_window_bytes": local * beyond * per_layer_block}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=_repo.results("hybrid-kv-overhead", "results.json"))
    ap.add_argument("--port", type=int, default=9510)
    ap.add_argument("--default-model", default=os.path.expanduser("~/.cache/pagemill/SmolLM2-135M-Instruct"))
    a = ap.parse_args()
    tiny = measure_tiny(a.port, Path(a.default_model))
    print(f"tiny Gemma 3: {tiny['config']}")
    print("| tokens | blocks used (measured) | released | beyond window, per local layer | beyond window, bytes |")
    print("| --- | --- | --- | --- | --- |")
    for r in tiny["rows"]:
        print(f"| {r['tokens']} | {r['blocks_used']:.0f} | {r['released']:.0f} | "
              f"{r['beyond_window_blocks_per_local_layer']:.0f} blocks | {r['beyond_window_bytes']} |")
    big = [published("Gemma 3 1B", 26, 22, 1, 256, 512, 32768), published("Gemma 2 9B", 42, 21, 8, 256, 4096, 8192)]
    mib = 2**20
    print("| model | context | held (all layers) | local layers beyond window |")
    print("| --- | --- | --- | --- |")
    for b in big:
        print(f"| {b['model']} | {b['context']} | {b['held_bytes'] / mib:.0f} MiB | {b['beyond_window_bytes'] / mib:.0f} MiB |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"tiny_gemma3": tiny, "published": big}, indent=1))


if __name__ == "__main__":
    main()
