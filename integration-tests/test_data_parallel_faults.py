"""Data-parallel shard groups under faults (`--data-parallel 2`, tiny
random-weight model): a group whose shard is killed, or stops answering,
mid-stream hands its streams to the other group, which completes them with
the exact greedy text; /health says degraded, then ok once the group is back."""

import concurrent.futures as cf
import json
import threading
import time

import httpx
import psutil
import pytest

from reliability import stopped_after
from server import launch
from test_data_parallel import KV, _generate, _group_metric


def _stream(url: str, prompt: str, n: int, started: threading.Event) -> dict:
    """Every token text of a greedy stream, and its final generated_text."""
    texts, final = [], None
    body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "ignore_eos_token": True}}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            assert "error" not in event, event
            texts.append(event["token"]["text"])
            if len(texts) >= 5:
                started.set()
            final = event.get("generated_text") or final
    return {"tokens": "".join(texts), "final": final, "count": len(texts)}


def _group_shard(server, group: int) -> psutil.Process:
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    return next(k for k in kids if f"shard-{group}-0.sock" in " ".join(k.cmdline()))


def _health(server) -> tuple[int, dict]:
    r = httpx.get(f"{server.url}/health", timeout=15)
    return r.status_code, r.json()


@pytest.mark.timeout(110)
def test_killed_group_hands_its_streams_over_and_comes_back(tiny_model_dir):
    s = launch(str(tiny_model_dir), *KV, "--data-parallel", "2")
    with stopped_after(s):
        n = 400
        prompts = [f"Story {i}: once upon a time there was a number {i * 37} and" for i in range(6)]
        with cf.ThreadPoolExecutor(6) as pool:
            reference = list(pool.map(lambda p: _generate(s.url, p, n, ignore_eos=True), prompts))
        placed_before = _group_metric(s, "pagemill_group_requests_placed_total")
        started = [threading.Event() for _ in prompts]
        with cf.ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(_stream, s.url, p, n, e) for p, e in zip(prompts, started)]
            for e in started:
                assert e.wait(60), "a stream never started"
            batch = [g["batch_size"] for g in s.info()["groups"]]
            victim = _group_shard(s, 0)
            victim.kill()
            # Out of rotation while it reloads: degraded, still 200.
            seen = set()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                code, body = _health(s)
                seen.add((code, body.get("status")))
                if (200, "degraded") in seen:
                    assert [g["serving"] for g in body["groups"]] == [False, True], body
                    break
                time.sleep(0.1)
            assert (200, "degraded") in seen, seen
            results = [f.result() for f in streams]
        assert batch[0] > 0, f"nothing ran on the killed group: {batch}"
        for ref, got in zip(reference, results):
            assert got["count"] == n
            assert got["tokens"] == ref and got["final"] == ref
        assert s.metric("pagemill_requeued_total") >= batch[0]
        # The launcher restarts the group's shard; the router re-admits it.
        deadline = time.monotonic() + 60
        while _health(s) != (200, {"status": "ok"}):
            assert time.monotonic() < deadline, _health(s)
            time.sleep(0.5)
        assert s.info()["groups"][0]["serving"]
        placed = _group_metric(s, "pagemill_group_requests_placed_total")
        assert placed[0] >= placed_before[0]
        # Group 0 serves again: prompts no group holds land on it too.
        for i in range(4):
            _generate(s.url, f"A new prompt {i} that no group has seen", 8)
        assert _group_metric(s, "pagemill_group_requests_placed_total")[0] > placed[0]


@pytest.mark.timeout(120)
def test_a_group_that_stops_answering_leaves_rotation_and_comes_back(tiny_model_dir):
    """SIGSTOP: the shard neither dies nor answers. Its streams move to the other group once a
    Health probe beside the running step goes unanswered (10 s); SIGCONT brings the group back."""
    import signal

    s = launch(str(tiny_model_dir), *KV, "--data-parallel", "2")
    with stopped_after(s):
        n = 1500
        prompts = [f"Tale {i}: in a land of {i * 11} rivers" for i in range(4)]
        with cf.ThreadPoolExecutor(4) as pool:
            reference = list(pool.map(lambda p: _generate(s.url, p, n, ignore_eos=True), prompts))
        started = [threading.Event() for _ in prompts]
        victim = _group_shard(s, 0)
        try:
            with cf.ThreadPoolExecutor(4) as pool:
                streams = [pool.submit(_stream, s.url, p, n, e) for p, e in zip(prompts, started)]
                for e in started:
                    assert e.wait(60), "a stream never started"
                batch = [g["batch_size"] for g in s.info()["groups"]]
                victim.send_signal(signal.SIGSTOP)
                results = [f.result() for f in streams]
            assert batch[0] > 0, batch
            for ref, got in zip(reference, results):
                assert got["count"] == n and got["tokens"] == ref and got["final"] == ref
            code, body = _health(s)
            assert (code, body["status"]) == (200, "degraded"), body
            assert s.metric("pagemill_requeued_total") >= batch[0]
        finally:
            victim.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while _health(s) != (200, {"status": "ok"}):
            assert time.monotonic() < deadline, _health(s)
            time.sleep(0.5)
