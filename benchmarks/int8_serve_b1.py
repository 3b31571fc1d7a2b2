"""Batch-1 time per output token through the real server: `--dtype bfloat16 --quantize int8` against
`--dtype bfloat16`, both launched at once (different ports), requests alternating between them.

    python benchmarks/int8_serve_b1.py [--rounds 8] [--threads 2] [--json out.json]

Each round sends one streaming `/v1/completions` request (64 prompt tokens, 128 output tokens,
ignore_eos, greedy) to each server in turn, one at a time, so the two see the same machine noise.
Time per output token of a request: (last token - first token) / (tokens - 1) (bench/metrics.py);
medians over the rounds (the first round of each is a warm-up and dropped). Run it with the
`pagemill` of the build under test first on PATH (e.g. a venv's bin).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

import httpx

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.bench.cli import resolve_model_dir
from pagemill.bench.datasets import random_dataset
from pagemill.bench.endpoints import ENDPOINTS, send

SERVERS = {"bf16": ["--dtype", "bfloat16"], "int8 (bf16 rest)": ["--dtype", "bfloat16", "--quantize", "int8"]}


def launch(name: str, extra: list[str], port: int, threads: int, model_dir: str, log_dir: Path) -> subprocess.Popen:
    cmd = [shutil.which("pagemill") or "pagemill", "launch", "--model", model_dir, "--port", str(port),
           "--master-port", str(port + 100), "--num-threads", str(threads), *extra]  # fmt: skip
    log = open(log_dir / f"{name.split()[0]}-{port}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, timeout_s: float = 300) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


async def rounds(urls: dict[str, str], reqs, n: int) -> dict[str, list[float]]:
    tpot: dict[str, list[float]] = {k: [] for k in urls}
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(n):
            for name, url in urls.items():
                rec = await send(client, url, ENDPOINTS["openai"], reqs[i % len(reqs)])
                if not rec.success:
                    raise RuntimeError(f"{name}: {rec.error}")
                if i > 0:  # the first round warms up
                    tpot[name].append(rec.tpot * 1e3)
    return tpot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=3310)
    p.add_argument("--json", default=_repo.results("int8-serve-b1", "int8_serve_b1.json"))
    a = p.parse_args()
    from tokenizers import Tokenizer

    model_dir = resolve_model_dir(None)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    reqs = random_dataset(tok, a.rounds, 64, 128, 128)
    log_dir = Path("/tmp/int8_serve_b1")
    log_dir.mkdir(exist_ok=True)
    procs, urls = [], {}
    try:
        for i, (name, extra) in enumerate(SERVERS.items()):
            port = a.port + i
            procs.append(launch(name, extra, port, a.threads, model_dir, log_dir))
            urls[name] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            wait_ready(url)
        tpot = asyncio.run(rounds(urls, reqs, a.rounds + 1))
    finally:
        for proc in procs:  # the launcher and its shards: the session this script started
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)
    res = {"threads": a.threads, "rounds": a.rounds, "tpot_ms": tpot,
           "median_ms": {k: statistics.median(v) for k, v in tpot.items()}}  # fmt: skip
    for k, v in res["median_ms"].items():
        print(f"{k}: {v:.1f} ms per output token (median of {len(tpot[k])}; all: "
              + ", ".join(f"{x:.1f}" for x in tpot[k]) + ")")  # fmt: skip
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
