"""Quantized KV cache on the CPU against the full-precision cache: capacity and quality.

    python benchmarks/kv_quant_quality.py --json benchmarks/results/kv-quant-quality/kv_quant_quality.json

Launches `pagemill launch` on the default model once per --kv-cache-dtype
(auto = the model dtype, bf16 here; fp8_e4m3; fp8_e5m2; int8), each with the same
--kv-cache-memory, and sends the same fixed prompts (passages of
benchmarks/texts/public_domain_en.txt) as greedy /v1/completions with
logprobs. Against the full-precision cache it reports:

- blocks: the pool's KV blocks (`pagemill_kv_blocks_total`) for the same bytes;
- identical: prompts whose whole greedy continuation is identical;
- agreement: the share of generated positions before the first divergence
  (positions after a divergence condition on different text, so they are
  not compared);
- |d logprob|: mean and max absolute difference of the chosen token's
  logprob over those agreeing positions: how far the quantized cache moves
  the model's distribution where it still picks the same token.

Prints a table and writes JSON. One server at a time; the machine should be
otherwise idle only for the timing of startup, not for these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

import _repo  # noqa: E402,F401  (the repository from this file's path)

TEXT = Path(__file__).parent / "texts" / "public_domain_en.txt"


def prompts(n: int, words: int) -> list[str]:
    body = TEXT.read_text().split()
    step = max(1, (len(body) - words) // max(1, n))
    return [" ".join(body[i * step : i * step + words]) for i in range(n)]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("server did not become ready")


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def run_server(kv: str, args, texts: list[str]) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "pagemill", "launch", "--port", str(args.port), "--dtype", args.dtype,
           "--kv-cache-memory", args.kv_cache_memory, "--kv-cache-dtype", kv]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(url, proc, 600)
        blocks = metric(url, "pagemill_kv_blocks_total")
        outs = []
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        with httpx.Client(timeout=600) as c:
            for p in texts:
                body = {"model": model, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0,
                        "logprobs": 1, "ignore_eos": True}  # fmt: skip
                r = c.post(f"{url}/v1/completions", json=body)
                r.raise_for_status()
                lp = r.json()["choices"][0]["logprobs"]
                outs.append({"tokens": lp["tokens"], "logprobs": lp["token_logprobs"]})
        return {"kv_cache_dtype": kv, "blocks": blocks, "outputs": outs}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def compare(ref: dict, other: dict) -> dict:
    agree = total = identical = 0
    diffs: list[float] = []
    for a, b in zip(ref["outputs"], other["outputs"]):
        n = len(a["tokens"])
        total += n
        k = 0
        while k < n and k < len(b["tokens"]) and a["tokens"][k] == b["tokens"][k]:
            diffs.append(abs(a["logprobs"][k] - b["logprobs"][k]))
            k += 1
        agree += k
        identical += k == n
    return {"kv_cache_dtype": other["kv_cache_dtype"], "blocks": other["blocks"],
            "capacity_x": other["blocks"] / ref["blocks"], "identical": identical, "prompts": len(ref["outputs"]),
            "agreement": agree / total, "mean_abs_dlogprob": sum(diffs) / max(1, len(diffs)),
            "max_abs_dlogprob": max(diffs, default=0.0)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", default="auto,fp8_e4m3,fp8_e5m2,int8", help="kv cache dtypes; the first is the reference")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=9081)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    texts = prompts(args.prompts, args.prompt_words)
    runs = [run_server(kv, args, texts) for kv in args.kv.split(",")]
    rows = [compare(runs[0], r) for r in runs]
    print(f"| kv cache | blocks ({args.kv_cache_memory}) | capacity | identical | agreement | mean abs d logprob | max |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | {r['blocks']:.0f} | {r['capacity_x']:.2f}x | {r['identical']}/{r['prompts']} "
              f"| {r['agreement']:.3f} | {r['mean_abs_dlogprob']:.4f} | {r['max_abs_dlogprob']:.4f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
