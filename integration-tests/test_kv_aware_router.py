"""vllm-router's `kv_aware` policy, the real wheel, in front of two pagemill
servers that publish KV-cache events: requests sharing a prefix that one
server holds go to that server, which the router learns from its events
alone (nothing else tells it where a prefix is cached)."""

import json
import time

import httpx
import pytest

from gateway_routers import start_router
from server import free_port, launch

BS = 16
ARGS = ("--block-size", str(BS), "--kv-cache-memory", "64MiB", "--max-input-tokens", "1024", "--max-total-tokens", "1280")
SYSTEM = "You are the librarian of the east wing. " + " ".join(f"Shelf {k} holds atlases of region {k}." for k in range(40))


def _complete(url: str, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.timeout(180)
def test_kv_aware_routes_a_shared_prefix_to_the_server_whose_events_announced_it(tiny_model_dir):
    servers, pubs = [], []
    try:
        for _ in range(2):
            pubs.append(free_port())
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pubs[-1]}"}
            servers.append(launch(str(tiny_model_dir), *ARGS, "--kv-events-config", json.dumps(config)))
        model = servers[0].info()["model_id"]
        extra = ["--kv-event-block-size", str(BS), "--kv-event-model", str(tiny_model_dir)]
        for s, p in zip(servers, pubs):
            extra += ["--kv-event-source", f"{s.url}=tcp://127.0.0.1:{p}"]
        router = start_router("vllm-router", [s.url for s in servers], model, policy="kv_aware", extra=tuple(extra))
        try:
            time.sleep(1.0)  # the router's subscribers connect before anything is published
            # Server 1 alone computes the shared prefix (a request sent to it directly).
            _complete(servers[1].url, model, f"{SYSTEM}\nQuestion: where are the maps?\nAnswer:")
            time.sleep(1.0)
            before = [s.metric("pagemill_prefill_tokens_total") for s in servers]
            for q in ("Which shelf is first?", "Who keeps the atlases?", "Is region 7 here?", "Say hello."):
                _complete(router.url, model, f"{SYSTEM}\nQuestion: {q}\nAnswer:")
            computed = [s.metric("pagemill_prefill_tokens_total") - b for s, b in zip(servers, before)]
        finally:
            router.stop()
        # All four went to server 1, each computing only past the cached prefix.
        assert computed[0] == 0, (computed, router.logs())
        assert 0 < computed[1] < 4 * 2 * BS, computed
    finally:
        for s in servers:
            s.stop()
