"""The router planning decode steps ahead of the reply in flight (`--schedule-ahead`: at every
batch size; by default from 16 sequences), end to end: concurrent streams of mixed lengths, a request joining a running batch, a client leaving
mid-stream, and the same greedy tokens as one step at a time."""

import concurrent.futures as cf

import httpx
import pytest

from server import launch
from test_batching import prompt, stream_one, wait_all_free


@pytest.fixture(scope="module")
def ahead(tiny_model_dir):
    s = launch(str(tiny_model_dir), "--schedule-ahead")
    yield s
    s.stop()


def greedy(url: str, i: int, n: int) -> list[int]:
    body = {"inputs": prompt(i), "parameters": {"max_new_tokens": n, "ignore_eos_token": True, "details": True}}
    r = httpx.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def test_streams_planned_ahead_complete_with_every_token_and_free_their_blocks(ahead):
    before = ahead.metric("pagemill_steps_ahead_total")
    with cf.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: stream_one(ahead.url, i), range(12)))
    for res in results:
        events = res["events"]
        assert "error" not in events[-1], events[-1]
        assert [e["index"] for e in events] == list(range(1, res["max_new"] + 1))
        assert events[-1]["details"]["finish_reason"] == "length"
    assert ahead.metric("pagemill_steps_ahead_total") > before + 10, "no step went ahead"
    info = wait_all_free(ahead)
    assert info["kv_blocks_used"] == 0 and info["batch_size"] == 0


def test_tokens_are_those_of_one_step_at_a_time(ahead, tiny_model_dir):
    """The same greedy requests on a server with --no-schedule-ahead give the same tokens."""
    got = [greedy(ahead.url, i, 24) for i in range(3)]
    plain = launch(str(tiny_model_dir), "--no-schedule-ahead")
    try:
        want = [greedy(plain.url, i, 24) for i in range(3)]
        assert plain.metric("pagemill_steps_ahead_total") == 0
    finally:
        plain.stop()
    assert got == want


def test_by_default_only_steps_of_16_sequences_go_ahead(tiny_model_dir):
    s = launch(str(tiny_model_dir))
    try:
        with cf.ThreadPoolExecutor(3) as pool:  # three at a time: never ahead
            small = list(pool.map(lambda i: greedy(s.url, i, 24), range(3)))
        assert s.metric("pagemill_steps_ahead_total") == 0
        # Long enough that all twenty decode together for hundreds of steps whenever they arrive
        # (at 48 tokens the tiny model finished the first before the last had arrived, now and then).
        body = {"parameters": {"max_new_tokens": 400, "ignore_eos_token": True}}
        with cf.ThreadPoolExecutor(20) as pool:  # twenty: the steps of 16+ go ahead
            codes = list(pool.map(lambda i: httpx.post(f"{s.url}/generate", json={"inputs": prompt(i), **body},
                                                       timeout=300).status_code, range(20)))
        assert codes == [200] * 20
        assert s.metric("pagemill_steps_ahead_total") > 0, "no step of 16+ sequences went ahead"
    finally:
        s.stop()
    assert all(len(t) == 24 for t in small)


def test_a_client_leaving_and_one_joining_while_steps_go_ahead(ahead):
    long_body = {"inputs": prompt(4), "parameters": {"max_new_tokens": 200, "ignore_eos_token": True}}
    with cf.ThreadPoolExecutor(2) as pool:
        keeper = pool.submit(lambda: httpx.post(f"{ahead.url}/generate", json=long_body, timeout=300))
        with httpx.stream("POST", f"{ahead.url}/generate_stream", json=long_body, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 10:
                    break  # leaves mid-stream
        joined = stream_one(ahead.url, 5)
        assert len(joined["events"]) == joined["max_new"] and "error" not in joined["events"][-1]
        r = keeper.result()
    assert r.status_code == 200 and r.json()["generated_text"]
    assert wait_all_free(ahead)["kv_blocks_used"] == 0
