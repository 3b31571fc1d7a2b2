"""The real server with --speculate 4 (n-gram and draft model) against the same server
without speculation: greedy outputs are token-identical on 32 concurrent prompts."""

import concurrent.futures as cf

import httpx
import pytest

from server import launch

TEXTS = [
    "The museum opens at nine, closes at five, and is free on Sundays.",
    "def add(a, b):\n    return a + b",
    "Alice sent Bob the report on Monday; Bob forwarded it to Carol on Tuesday.",
    "Rain is expected in the north, sun in the south, and wind along the coast.",
]
ASKS = ["Repeat this text exactly:", "Quote the following sentence word for word:",
        "Summarise, quoting the original:", "Copy this:"]
PROMPTS = [f"<|im_start|>user\n{ASKS[i % 4]} {TEXTS[(i // 4) % 4]} (#{i})<|im_end|>\n<|im_start|>assistant\n"
           for i in range(32)]
ARGS = ("--max-batch-prefill-tokens", "4096", "--max-input-tokens", "512", "--max-total-tokens", "1024",
        "--kv-cache-memory", "512MiB", "--max-concurrent-requests", "64")


def run_all(url: str) -> list[list[int]]:
    def one(prompt: str) -> list[int]:
        r = httpx.post(f"{url}/generate", timeout=600, json={
            "inputs": prompt, "parameters": {"max_new_tokens": 24, "details": True}})
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    with cf.ThreadPoolExecutor(32) as pool:
        return list(pool.map(one, PROMPTS))


def run_all_one(url: str, prompt: str) -> list[int]:
    r = httpx.post(f"{url}/generate", timeout=600, json={
        "inputs": prompt, "parameters": {"max_new_tokens": 24, "details": True}})
    return [t["id"] for t in r.json()["details"]["tokens"]]


@pytest.fixture(scope="module")
def reference(default_model_dir):
    s = launch(str(default_model_dir), *ARGS)
    try:
        return run_all(s.url)
    finally:
        s.stop()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_matches_no_speculation(default_model_dir, reference, method):
    extra = ["--speculate", "4", "--speculate-method", method]
    if method == "draft":
        extra += ["--draft-model", str(default_model_dir)]  # the only model at hand: acceptance ~100%
    s = launch(str(default_model_dir), *ARGS, *extra)
    try:
        assert s.info().get("speculate", 4) == 4
        assert run_all(s.url) == reference
        # One copy request alone: without speculation its 24 tokens take 23 decode steps.
        before = s.metric("pagemill_decode_steps_total")
        tokens = run_all_one(s.url, PROMPTS[0])
        steps = s.metric("pagemill_decode_steps_total") - before
    finally:
        s.stop()
    assert tokens == reference[0]
    assert steps < 23 if method == "ngram" else steps <= 8, steps
