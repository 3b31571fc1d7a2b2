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


def decode_steps_during(server, long_prompt: str) -> int:
    """Decode steps the server runs while `long_prompt` waits for its first
    token, with another request streaming (so there is a batch to decode)."""
    running = threading.Event()

    def stream():
        body = {"inputs": "Write a long story about a lighthouse.",
                "parameters": {"max_new_tokens": 400, "ignore_eos_token": True}}  # fmt: skip
        with httpx.stream("POST", f"{server.url}/generate_stream", json=body, timeout=600) as r:
            for _ in sse_events(r):
                running.set()

    with cf.ThreadPoolExecutor(1) as pool:
        f = pool.submit(stream)
        assert running.wait(300)
        before = server.metric("pagemill_decode_steps_total")
        r = httpx.post(f"{server.url}/generate", timeout=600,
                       json={"inputs": long_prompt, "parameters": {"max_new_tokens": 1}})  # fmt: skip
        steps = server.metric("pagemill_decode_steps_total") - before
        assert r.status_code == 200, r.text
        f.result(timeout=600)
    return int(steps)


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
            during = decode_steps_during(s, ps[0])
            results[name] = (outputs, computed, during)
        finally:
            s.stop()
    out_chunked, computed_chunked, during_chunked = results["chunked"]
    out_whole, computed_whole, during_whole = results["whole"]
    assert out_chunked == out_whole, "chunked prefill changed greedy outputs"
    # Every prompt token is computed exactly once either way.
    assert computed_chunked == computed_whole
    # ~11 chunks of the long prompt, each followed by a decode step of the
    # running stream; unchunked, the stream waits out one long prefill (the
    # counts also include steps run while the request was parsed and queued).
    assert during_chunked >= during_whole + 5, (during_chunked, during_whole)
