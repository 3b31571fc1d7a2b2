"""Chunked prefill (`--prefill-chunk-tokens`) on the default model, against
the same requests on a server that prefills every prompt in one step."""

import concurrent.futures as cf
import threading

import httpx
import pytest

from server import launch, sse_events
from test_kv_cache import run_all, system_prompt

COMMON = ("--max-batch-prefill-tokens", "2048", "--max-input-tokens", "1024", "--max-total-tokens", "1536",
          "--kv-cache-memory", "512MiB", "--no-prefix-caching")
CHUNK = "64"


def prompts(model_dir) -> list[str]:
    # One long prompt (~10 chunks, not block- or chunk-aligned) and short
    # ones that arrive with it and share the chunk budget of its steps.
    long = system_prompt(model_dir, 650)
    return [long + "\nQuestion: which policy covers parcels?", "Hello there", "Count to five:", long[:900]]


def stream_tokens_during(server, long_prompt: str) -> int:
    """Tokens a running stream receives between sending `long_prompt` and its first token."""
    counted, started, done = [0], threading.Event(), threading.Event()

    def stream():
        body = {"inputs": "Write a long story about a lighthouse.",
                "parameters": {"max_new_tokens": 200, "ignore_eos_token": True}}  # fmt: skip
        with httpx.stream("POST", f"{server.url}/generate_stream", json=body, timeout=600) as r:
            for _ in sse_events(r):
                started.set()
                if done.is_set():
                    break
                if long_sent.is_set():
                    counted[0] += 1

    long_sent = threading.Event()
    with cf.ThreadPoolExecutor(2) as pool:
        f = pool.submit(stream)
        assert started.wait(300)
        long_sent.set()
        r = httpx.post(f"{server.url}/generate", timeout=600,
                       json={"inputs": long_prompt, "parameters": {"max_new_tokens": 1}})  # fmt: skip
        done.set()
        assert r.status_code == 200, r.text
        f.result(timeout=600)
    return counted[0]


@pytest.mark.timeout(900)
def test_chunked_prefill_matches_unchunked_greedy_output_and_interleaves_decode(default_model_dir):
    ps = prompts(default_model_dir)
    results = {}
    for name, extra in (("chunked", ("--prefill-chunk-tokens", CHUNK)), ("whole", ())):
        s = launch(str(default_model_dir), *COMMON, *extra)
        try:
            before = s.info()["prefill_tokens_total"]
            outputs = run_all(s, ps, max_new_tokens=12, workers=4)
            computed = s.info()["prefill_tokens_total"] - before
            during = stream_tokens_during(s, ps[0])
            results[name] = (outputs, computed, during)
        finally:
            s.stop()
    out_chunked, computed_chunked, during_chunked = results["chunked"]
    out_whole, computed_whole, during_whole = results["whole"]
    assert out_chunked == out_whole, "chunked prefill changed greedy outputs"
    # Every prompt token is computed exactly once either way.
    assert computed_chunked == computed_whole
    # ~10 chunks of the long prompt, each followed by a decode step of the
    # running stream; unprefixed, the stream waits for the one long prefill.
    assert during_chunked >= 5, (during_chunked, during_whole)
    assert during_chunked > during_whole
