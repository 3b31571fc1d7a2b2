"""Bad input gets a 4xx with `{error, error_type}`, never a crash."""

import httpx
import pytest


def post(server, body, route="/generate", **kw):
    return httpx.post(f"{server.url}{route}", timeout=30, **kw, **({"json": body} if body is not None else {}))


@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
@pytest.mark.parametrize("params,needle", [
    ({"temperature": 0}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"typical_p": 2}, "typical_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -5}, "max_new_tokens"),
    ({"max_new_tokens": 5000}, "max_new_tokens"),
    ({"top_n_tokens": 100}, "top_n_tokens"),
    ({"stop": ["x"] * 100}, "stop"),
    ({"truncate": 0}, "truncate"),
])
def test_bad_parameters_are_422(server, route, params, needle):
    r = post(server, {"inputs": "Hello", "parameters": params}, route=route)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error_type"] == "validation"
    assert needle in body["error"]


def test_empty_input(server):
    r = post(server, {"inputs": ""})
    assert r.status_code == 422
    assert r.json()["error_type"] == "validation"


def test_input_too_long(server):
    r = post(server, {"inputs": "hello " * 3000, "parameters": {"max_new_tokens": 1}})
    assert r.status_code == 422
    assert "inputs" in r.json()["error"]


def test_input_plus_new_tokens_over_total(server):
    # ~1000 prompt tokens + 1100 new > max_total_tokens 2048
    r = post(server, {"inputs": "hello " * 1000, "parameters": {"max_new_tokens": 1100}})
    assert r.status_code == 422
    assert "max_new_tokens" in r.json()["error"]


def test_truncate_keeps_prompt_within_limits(server):
    r = post(server, {"inputs": "hello " * 3000, "parameters": {"max_new_tokens": 2, "truncate": 100}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw", [b"{not json", b'{"inputs": 5}', b'{"parameters": {}}', b"[]",
                                 b'{"inputs": "a", "parameters": {"max_new_tokens": "ten"}}'])
def test_malformed_json_is_422(server, raw):
    r = httpx.post(f"{server.url}/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["error_type"] == "invalid_json"


def test_unknown_route_is_404_json(server):
    r = httpx.get(f"{server.url}/nope")
    assert r.status_code == 404
    assert r.json()["error_type"] == "not_found"


def test_server_still_serves_after_bad_input(server):
    r = post(server, {"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200
