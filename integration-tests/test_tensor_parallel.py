"""--num-shard 2 on CPU (gloo) against --num-shard 1 on the default model: the same
greedy tokens, and every prompt and generated token's logprob within 1e-4.

SmolLM2 has 9 query / 3 KV heads, so 2 shards split it unevenly (2 KV groups and
1): this is the case a plain heads // world split cannot do.
"""

import concurrent.futures as cf
import os
import signal
import time

import httpx
import psutil

from server import HOLD_ARGS, HOLD_TOKENS, launch, sse_events

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
]
NEW_TOKENS = 16
TOL = 1e-4
# Small limits: warmup runs the largest prefill once on every shard.
LIMITS = ("--max-batch-prefill-tokens", "256", "--max-input-tokens", "128", "--max-total-tokens", "256",
          "--max-batch-size", "8", "--kv-cache-memory", "64MiB")  # fmt: skip


def _generate_all(url: str) -> list[dict]:
    body = lambda p: {"inputs": p, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True,  # noqa: E731
                                                  "decoder_input_details": True, "ignore_eos_token": True}}
    # Concurrent: the prompts share prefill and decode batches (mixed lengths).
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        rs = list(pool.map(lambda p: httpx.post(f"{url}/generate", json=body(p), timeout=300), PROMPTS))
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json()["details"] for r in rs]


def _run(model: str, shards: int) -> tuple[list[dict], dict]:
    s = launch(model, "--num-shard", str(shards), *LIMITS, timeout=600)
    try:
        return _generate_all(s.url), s.info()
    finally:
        assert s.stop() == 0, s.logs()


def test_two_shards_match_one_shard(default_model_dir):
    one, info1 = _run(str(default_model_dir), 1)
    two, info2 = _run(str(default_model_dir), 2)
    assert (info1.get("num_shards"), info2.get("num_shards")) == (1, 2), (info1, info2)
    max_diff = 0.0
    for prompt, a, b in zip(PROMPTS, one, two):
        assert [t["id"] for t in a["tokens"]] == [t["id"] for t in b["tokens"]], prompt
        assert [t["id"] for t in a["prefill"]] == [t["id"] for t in b["prefill"]], prompt
        # The first prompt token has no logprob (null).
        pairs = [(x["logprob"], y["logprob"])
                 for x, y in zip(a["prefill"][1:] + a["tokens"], b["prefill"][1:] + b["tokens"])]
        max_diff = max(max_diff, *(abs(x - y) for x, y in pairs))
    print(f"\n2 shards vs 1: identical greedy tokens ({len(PROMPTS)} prompts x {NEW_TOKENS}), "
          f"max |logprob diff| = {max_diff:.3e} over prompt and generated tokens")  # fmt: skip
    assert max_diff < TOL


def test_losing_a_nonzero_rank_fails_the_request(tiny_model_dir):
    """Rank 1 dies mid-stream: rank 0 is stuck in a collective, the router must still
    end the stream with an error and the launcher must exit."""
    s = launch(str(tiny_model_dir), "--num-shard", "2", "--kv-cache-memory", "64MiB", *HOLD_ARGS)
    kids = psutil.Process(s.proc.pid).children(recursive=True)
    rank1 = [k.pid for k in kids if "--rank 1" in " ".join(k.cmdline())]
    assert len(rank1) == 1
    body = {"inputs": "hello there", "parameters": {"max_new_tokens": HOLD_TOKENS, "ignore_eos_token": True}}
    with cf.ThreadPoolExecutor(1) as pool:
        def stream():
            with httpx.stream("POST", f"{s.url}/generate_stream", json=body, timeout=120) as r:
                return list(sse_events(r))

        fut = pool.submit(stream)
        time.sleep(1.5)
        start = time.monotonic()
        os.kill(rank1[0], signal.SIGKILL)
        events = fut.result(timeout=120)
        took = time.monotonic() - start
    print(f"\nrank 1 killed: stream ended with an error after {took:.1f}s")
    assert events and events[-1].get("error_type") == "generation", events[-1:]
    assert took < 60, f"the error took {took:.0f}s"
    assert s.proc.wait(60) != 0
    assert "shard 1 exited" in s.logs()


def test_shards_started_from_the_environment(tiny_model_dir, tmp_path):
    """The documented multi-node recipe on one machine: `pagemill shard` per rank
    configured only through RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, then
    `pagemill router` over their sockets in rank order."""
    import subprocess
    import sys

    from server import free_port

    socks = [str(tmp_path / f"shard-{r}.sock") for r in range(2)]
    port, master = free_port(), str(free_port())
    procs = []
    try:
        for r, sock in enumerate(socks):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=master)
            procs.append(subprocess.Popen([sys.executable, "-m", "pagemill", "shard", "--model-dir",
                                           str(tiny_model_dir), "--uds-path", sock, "--kv-cache-memory", "64MiB",
                                           "--num-threads", "1"], env=env))  # fmt: skip
        argv = [sys.executable, "-m", "pagemill", "router", "--tokenizer-dir", str(tiny_model_dir),
                "--port", str(port), "--max-batch-prefill-tokens", "256", "--max-input-tokens", "128",
                "--max-total-tokens", "256"]  # fmt: skip
        for sock in socks:
            argv += ["--shard-uds-path", sock]
        procs.append(subprocess.Popen(argv))
        deadline = time.monotonic() + 180
        while True:
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "router not healthy"
            time.sleep(0.5)
        info = httpx.get(f"http://127.0.0.1:{port}/info", timeout=10).json()
        assert info["num_shards"] == 2
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                       json={"inputs": "hello", "parameters": {"max_new_tokens": 5, "details": True}})
        assert r.status_code == 200 and len(r.json()["details"]["tokens"]) == 5, r.text
        for p in reversed(procs):  # router first, then the shards: all exit cleanly
            p.send_signal(signal.SIGTERM)
            assert p.wait(60) == 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
