"""pagemill as a Ray Serve application (`pagemill.serve.ray_app`) on a local Ray
cluster: 2 replicas, each running its own `pagemill launch` of a tiny model, serve
the unmodified `openai` client through Serve's HTTP proxy. One replica's server is
killed mid-stream: that stream ends with an error within seconds (no hang), the
stream on the other replica completes, and new requests are still served.

Needs the `ray` extra (`pip install -e '.[ray]'`; it is not in `test`: docs/deploy.md).
"""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import psutil
import pytest

from server import free_port

ray = pytest.importorskip("ray", reason="Ray Serve is the `ray` extra: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve")

ASK = [{"role": "user", "content": "Tell me a long story."}]
LONG = 1500  # tokens: seconds of decoding, far longer than the kill takes


@pytest.fixture(scope="module")
def serve_url(tiny_model_dir):
    from pagemill.serve.ray_app import app_builder

    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    launch_args = ("--dtype float32 --kv-cache-memory 64MiB --max-input-tokens 256 --max-total-tokens 4096 "
                   "--max-concurrent-requests 16")
    app = app_builder({"model": str(tiny_model_dir), "launch_args": launch_args,
                       "min_replicas": 2, "max_replicas": 2, "num_cpus": 1})
    serve.run(app, name="pagemill", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def client(url: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=retries, timeout=60)


def ask(c: openai.OpenAI, max_tokens: int = 8):
    return c.chat.completions.with_raw_response.create(model="m", messages=ASK, temperature=0, max_tokens=max_tokens,
                                                       extra_body={"ignore_eos": True})


def test_both_replicas_serve_the_openai_client(serve_url):
    c = client(serve_url)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: ask(c, max_tokens=64), range(8)))
    assert len({r.parse().choices[0].message.content for r in replies}) == 1, "greedy answers differ"
    assert len({r.headers["x-pagemill-pid"] for r in replies}) == 2, "the requests all went to one replica"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       c.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=64,
                                                 extra_body={"ignore_eos": True}, stream=True) if chunk.choices)
    assert streamed == replies[0].parse().choices[0].message.content


def streams_on_both_replicas(c: openai.OpenAI) -> dict:
    """One long stream per replica (pid of its server -> stream), each past its first token."""
    streams, extra = {}, []
    for _ in range(6):
        s = c.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=LONG, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        pid = int(s.response.headers["x-pagemill-pid"])
        if pid in streams:
            extra.append(s)
        else:
            streams[pid] = s
        if len(streams) == 2:
            break
    for s in extra:
        s.close()
    assert len(streams) == 2, "could not open a stream on each replica"
    return streams


def kill_tree(pid: int) -> None:
    """The replica's server crashes: its launcher, router and shards all SIGKILLed."""
    proc = psutil.Process(pid)
    for p in [*proc.children(recursive=True), proc]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def drain(stream) -> tuple[int, str | None]:
    """(completion tokens in the usage chunk, last finish reason) of the rest of a stream."""
    tokens, finish = 0, None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return tokens, finish


def test_a_replica_killed_mid_stream(serve_url):
    c = client(serve_url)
    streams = streams_on_both_replicas(c)
    victim, survivor = sorted(streams)
    for s in streams.values():
        next(iter(s))  # both are generating
    kill_tree(victim)
    with ThreadPoolExecutor(2) as pool:
        lost = pool.submit(drain, streams[victim])
        kept = pool.submit(drain, streams[survivor])
        started = time.monotonic()
        with pytest.raises(openai.APIError):
            lost.result(timeout=60)
        assert time.monotonic() - started < 30, "the lost stream took too long to fail"
        tokens, finish = kept.result(timeout=180)
    assert (tokens, finish) == (LONG, "length")
    # New requests are served (the dead replica answers 503 until Serve replaces it; the client retries those).
    after = client(serve_url, retries=5)
    for _ in range(4):
        r = ask(after)
        assert r.parse().usage.completion_tokens == 8
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
