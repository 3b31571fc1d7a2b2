"""/metrics (Prometheus, pagemill_* names, histograms, per-route counters),
/openapi.json and the offline /docs page."""

import re

import httpx
import pytest


def test_metrics_after_requests(server):
    for _ in range(2):
        r = httpx.post(f"{server.url}/generate", timeout=60,
                       json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
        assert r.status_code == 200
    httpx.post(f"{server.url}/generate", json={"inputs": "Hello", "parameters": {"top_k": 0}}, timeout=30)
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("pagemill_queue_size", "pagemill_batch_size", "pagemill_kv_blocks_used", "pagemill_kv_blocks_free",
                 "pagemill_decode_steps_total", "pagemill_prompt_tokens_total", "pagemill_generated_tokens_total"):
        assert re.search(rf"^{name} \d", text, re.M), name
    assert re.search(r'^pagemill_http_requests_total\{route="/generate",status="200"\} \d+', text, re.M)
    assert re.search(r'^pagemill_http_requests_total\{route="/generate",status="422"\} \d+', text, re.M)
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_duration_seconds",
              "request_queue_seconds"):
        count = re.search(rf"^pagemill_{h}_count (\d+)", text, re.M)
        assert count and int(count.group(1)) >= 1, h
        assert f'pagemill_{h}_bucket{{le="+Inf"}}' in text
    assert server.metric("pagemill_decode_steps_total") > 0


def test_openapi_spec(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    for path in ("/generate", "/generate_stream", "/", "/v1/chat/completions", "/v1/completions", "/v1/models",
                 "/v1/responses", "/v1/messages",
                 "/tokenize", "/health", "/info", "/metrics"):
        assert path in spec["paths"], path
    params = spec["components"]["schemas"]["GenerateParameters"]["properties"]
    assert {"max_new_tokens", "best_of", "grammar", "top_n_tokens"} <= set(params)


@pytest.mark.parametrize("path", ["/docs", "/docs/"])
def test_docs_page_is_self_contained(server, path):
    r = httpx.get(server.url + path)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    # Every script and stylesheet comes from this server (works offline).
    assets = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert assets and all(a.startswith("/docs/") for a in assets), assets
    for a in assets:
        asset = httpx.get(server.url + a)
        assert asset.status_code == 200 and len(asset.content) > 1000, a
    assert "/openapi.json" in r.text
