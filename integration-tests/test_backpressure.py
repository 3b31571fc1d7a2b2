"""Backpressure: past --max-concurrent-requests a request gets 429 at once;
a request that waits in the queue longer than --max-queue-wait-ms gets 429
`queue_timeout` and leaves the queue without holding a block."""

import concurrent.futures as cf
import json
import time

import httpx
import pytest

from reliability import wait_idle
from server import HOLD_ARGS, HOLD_TOKENS, launch

LONG = {"inputs": "hold the batch", "parameters": {"max_new_tokens": HOLD_TOKENS, "ignore_eos_token": True}}
WAIT_MS = 1500
SHORT = {"inputs": "wait for me", "parameters": {"max_new_tokens": 5, "ignore_eos_token": True}}


@pytest.fixture(scope="module")
def one_slot(tiny_model_dir):
    # One sequence per batch: a second request must wait in the queue.
    s = launch(str(tiny_model_dir), "--kv-cache-memory", "64MiB", *HOLD_ARGS, "--max-batch-size", "1",
               "--max-concurrent-requests", "3", "--max-queue-wait-ms", str(WAIT_MS))
    yield s
    s.stop()


def _hold(server, n: int):
    """Opens `n` long streams that occupy the batch (and concurrency permits)."""
    client = httpx.Client(timeout=120)
    streams = [client.stream("POST", f"{server.url}/generate_stream", json=LONG) for _ in range(n)]
    opened = [st.__enter__() for st in streams]
    assert all(r.status_code == 200 for r in opened)
    return client, streams


def _release(client, streams):
    for st in streams:
        st.__exit__(None, None, None)
    client.close()


@pytest.mark.timeout(120)
def test_queue_wait_is_bounded_and_frees_the_queue(one_slot):
    client, streams = _hold(one_slot, 1)
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{one_slot.url}/generate", json=SHORT, timeout=60)
        waited = time.monotonic() - t0
        assert r.status_code == 429, r.text
        assert r.json()["error_type"] == "queue_timeout"
        assert WAIT_MS / 1000 <= waited < WAIT_MS / 1000 + 5, waited
        print(f"\nqueue timeout (--max-queue-wait-ms {WAIT_MS}): 429 `queue_timeout` after {waited:.2f}s")
        # A stream that times out in the queue ends with the same error event.
        with httpx.stream("POST", f"{one_slot.url}/generate_stream", json=SHORT, timeout=60) as s:
            events = [json.loads(x[5:]) for x in s.iter_lines() if x.startswith("data:")]
        assert events == [{"error": events[0]["error"], "error_type": "queue_timeout"}], events
        r = httpx.post(f"{one_slot.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
        info = one_slot.info()
        assert info["queue_size"] == 0 and info["batch_size"] == 1, info
    finally:
        _release(client, streams)
    wait_idle(one_slot, timeout=10)
    # Once the batch is free the same request goes through.
    assert httpx.post(f"{one_slot.url}/generate", json=SHORT, timeout=60).status_code == 200


@pytest.mark.timeout(120)
def test_past_max_concurrent_requests_is_429_at_once(one_slot):
    client, streams = _hold(one_slot, 1)
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            # Two more fill the 3 permits while they wait in the queue ...
            waiting = [pool.submit(httpx.post, f"{one_slot.url}/generate", json=SHORT, timeout=60) for _ in range(2)]
            deadline = time.monotonic() + WAIT_MS / 1000
            while one_slot.info()["queue_size"] < 2:
                assert time.monotonic() < deadline, "the two requests never queued"
                time.sleep(0.02)
            # ... so the fourth is refused without waiting at all.
            t0 = time.monotonic()
            r = httpx.post(f"{one_slot.url}/generate", json=SHORT, timeout=60)
            took = time.monotonic() - t0
            assert r.status_code == 429 and r.json()["error_type"] == "overloaded", r.text
            assert took < 1.0, took
            print(f"\nconcurrency limit (3): the 4th request got 429 `overloaded` in {took * 1000:.0f} ms")
            for f in waiting:
                assert f.result().json()["error_type"] == "queue_timeout"
    finally:
        _release(client, streams)
    wait_idle(one_slot, timeout=10)
