"""vllm-router's `kv_aware` policy, the real wheel, in front of two pagemill
servers that publish KV-cache events: requests sharing a prefix that one
server holds go to that server, which the router learns from its events
alone (nothing else tells it where a prefix is cached)."""

import json
import subprocess
import time

import httpx
import pytest

from reliability import stopped_after
from server import free_port, launch

BS = 16
ARGS = ("--block-size", str(BS), "--kv-cache-memory", "64MiB", "--max-input-tokens", "1024", "--max-total-tokens", "1280")
SYSTEM = "You are the librarian of the east wing. " + " ".join(f"Shelf {k} holds atlases of region {k}." for k in range(40))


def _complete(url: str, prompt: str) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def _prefill(server) -> float:
    return server.metric("pagemill_prefill_tokens_total")


def _router(urls: list[str], pubs: list[int], model_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = ["vllm-router", "--worker-urls", *urls, "--policy", "kv_aware", "--port", str(port),
            "--prometheus-port", str(free_port()), "--kv-event-block-size", str(BS), "--kv-event-model", model_dir]
    for u, p in zip(urls, pubs):
        argv += ["--kv-event-source", f"{u}=tcp://127.0.0.1:{p}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("vllm-router did not come up")


@pytest.mark.timeout(180)
def test_kv_aware_routes_a_shared_prefix_to_the_server_whose_events_announced_it(tiny_model_dir):
    servers, pubs = [], []
    for _ in range(2):
        pubs.append(free_port())
        config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pubs[-1]}"}
        servers.append(launch(str(tiny_model_dir), *ARGS, "--kv-events-config", json.dumps(config)))
    with stopped_after(servers[0]), stopped_after(servers[1]):
        render = httpx.post(f"{servers[0].url}/v1/completions/render", json={"model": "tiny", "prompt": "hi"})
        if render.status_code == 404:
            pytest.skip("kv_aware reads prompts' token ids from /v1/completions/render, which this build lacks")
        proc, router = _router([s.url for s in servers], pubs, str(tiny_model_dir))
        try:
            time.sleep(1.0)  # the router's subscribers connect before anything is published
            # Server 1 alone computes the shared prefix (a request sent to it directly).
            _complete(servers[1].url, f"{SYSTEM}\nQuestion: where are the maps?\nAnswer:")
            time.sleep(1.0)
            before = [_prefill(s) for s in servers]
            for q in ("Which shelf is first?", "Who keeps the atlases?", "Is region 7 here?", "Say hello."):
                _complete(router, f"{SYSTEM}\nQuestion: {q}\nAnswer:")
            computed = [_prefill(s) - b for s, b in zip(servers, before)]
        finally:
            proc.terminate()
            proc.wait(10)
        # All four went to server 1, each computing only past the cached prefix.
        assert computed[0] == 0, computed
        assert 0 < computed[1] < 4 * 2 * BS, computed
