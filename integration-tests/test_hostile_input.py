"""Hand-written hostile input: oversized and deeply nested bodies, invalid
UTF-8, NaN/inf and out-of-range numbers, thousands of stop sequences, prompts
at and just over the token limits, malformed chat messages. Every answer is
a 4xx in the route's error shape (or a correct 200), never a 5xx; valid requests
interleaved from another thread all succeed; the router never panics."""

import json
import threading

import httpx
import pytest

from reliability import check, request, stopped_after, wait_idle
from server import error_message, launch

MAX_INPUT, MAX_TOTAL, PAYLOAD = 64, 128, 512 * 1000
NEST = 100_000


@pytest.fixture(scope="module")
def hostile(tiny_model_dir):
    s = launch(str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--max-input-tokens", str(MAX_INPUT),
               "--max-total-tokens", str(MAX_TOTAL), "--payload-limit", "512KB")
    valid = ValidTraffic(s.url)
    valid.start()
    with stopped_after(s):
        yield s
        valid.stop.set()
        valid.join(60)
        print(f"\nhostile: {valid.ok} valid requests interleaved, {len(valid.failures)} failed")
        # Valid requests kept being served, correctly, through every hostile one.
        assert valid.ok >= 10 and not valid.failures, (valid.ok, valid.failures[:3])
        wait_idle(s)
        assert "panicked" not in s.logs()


class ValidTraffic(threading.Thread):
    """A valid request (all flavours in turn) back to back while the hostile ones run."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.ok, self.failures = url, 0, []
        self.stop = threading.Event()

    def run(self):
        flavours = ["generate", "generate_stream", "completions", "completions_stream", "chat", "chat_stream"]
        with httpx.Client(timeout=60) as c:
            i = 0
            while not self.stop.is_set():
                f = flavours[i % len(flavours)]
                path, body = request(f, i, 6)
                try:
                    r = c.post(self.url + path, json=body)
                    check(f, 6, r.status_code, r.content)
                    self.ok += 1
                except Exception as e:  # noqa: BLE001 - every failure is recorded
                    self.failures.append(f"{f}: {e!r}"[:300])
                i += 1


def raw(server, path: str, data: bytes, ctype: str = "application/json") -> httpx.Response:
    return httpx.post(server.url + path, content=data, headers={"content-type": ctype}, timeout=60)


def assert_error(r: httpx.Response, status: int, error_type: str | None = None):
    """`status` as on the TGI routes: the OpenAI routes answer invalid input (TGI's 422)
    with a 400, and their body is OpenAI's `{"error": {message, type, param, code}}`."""
    openai_route = r.request.url.path.startswith("/v1/")
    if openai_route and status == 422:
        status = 400
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    if openai_route:
        assert isinstance(body["error"], dict) and body["error"]["message"], body
        code = body["error"]["code"]
    else:
        assert isinstance(body["error"], str) and body["error"]
        code = body["error_type"]
    if error_type:
        assert code == error_type, body


ROUTES = ["/generate", "/generate_stream", "/", "/tokenize", "/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("route", ROUTES)
def test_body_over_payload_limit_is_413(hostile, route):
    big = b'{"inputs": "' + b"a" * (PAYLOAD + 10) + b'"}'
    assert_error(raw(hostile, route, big), 413, "payload_too_large")
    # Chunked, without a Content-Length: cut off at the limit all the same.
    chunks = iter([b'{"inputs": "'] + [b"a" * 10_000] * (PAYLOAD // 10_000 + 2) + [b'"}'])
    r = httpx.post(hostile.url + route, content=chunks, headers={"content-type": "application/json"}, timeout=60)
    assert_error(r, 413, "payload_too_large")


@pytest.mark.parametrize("where", ["top", "inputs", "grammar", "chat_template_kwargs", "tools", "tool_calls"])
def test_deeply_nested_json_is_422(hostile, where):
    deep = b"[" * NEST + b"]" * NEST
    body, route = {
        "top": (deep, "/generate"),
        "inputs": (b'{"inputs": ' + deep + b"}", "/generate"),
        "grammar": (b'{"inputs": "a", "parameters": {"grammar": {"type": "json", "value": ' + deep + b"}}}",
                    "/generate"),
        "chat_template_kwargs": (b'{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"x": '
                                 + deep + b"}}", "/v1/chat/completions"),
        "tools": (b'{"messages": [{"role": "user", "content": "a"}], "tools": ' + deep + b"}", "/v1/chat/completions"),
        "tool_calls": (b'{"messages": [{"role": "user", "content": "a", "tool_calls": ' + deep + b"}]}",
                       "/v1/chat/completions"),
    }[where]
    assert len(body) < PAYLOAD
    assert_error(raw(hostile, route, body), 422, "invalid_json")


@pytest.mark.parametrize("data", [
    b'{"inputs": "\xff\xfe\xc3", "parameters": {"max_new_tokens": 2}}',  # invalid bytes
    b'{"inputs": "\xc0\xaf"}',  # overlong encoding
    b'{"inputs": "\xed\xa0\x80"}',  # UTF-8-encoded surrogate
    b'{"inp\xffuts": "a"}',  # in a key
    b'{"inputs": "\\ud800", "parameters": {"max_new_tokens": 2}}',  # lone surrogate escape
    b'{"inputs": "a\x00b"}',  # raw control character
    b"\xef\xbb\xbf{\"inputs\": \"a\"}",  # byte-order mark
    b"", b"null", b"{", b'{"inputs": "a"', b"\x00" * 1000,
])
@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_invalid_utf8_and_broken_json_is_422(hostile, data, route):
    assert_error(raw(hostile, route, data), 422, "invalid_json")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
@pytest.mark.parametrize("name", ["temperature", "top_p", "typical_p", "min_p", "repetition_penalty",
                                  "frequency_penalty", "presence_penalty"])
def test_nan_and_infinite_floats_are_422(hostile, name, value):
    r = raw(hostile, "/generate", f'{{"inputs": "a", "parameters": {{"{name}": {value}}}}}'.encode())
    assert_error(r, 422)


@pytest.mark.parametrize("value", ["1e39", "-1e39", "3.5e38"])
@pytest.mark.parametrize("route,name", [("/generate", "temperature"), ("/generate", "top_p"),
                                        ("/v1/completions", "temperature"), ("/v1/completions", "presence_penalty"),
                                        ("/v1/chat/completions", "top_p")])
def test_floats_past_f32_are_422(hostile, route, name, value):
    body = {"/generate": '{{"inputs": "a", "parameters": {{"{n}": {v}}}}}',
            "/v1/completions": '{{"prompt": "a", "{n}": {v}}}',
            "/v1/chat/completions": '{{"messages": [{{"role": "user", "content": "a"}}], "{n}": {v}}}'}[route]
    assert_error(raw(hostile, route, body.format(n=name, v=value).encode()), 422, "validation")


BIG = [2**64, 2**63, 2**32, -1, -(2**63), -(2**64)]


@pytest.mark.parametrize("value", BIG)
@pytest.mark.parametrize("name", ["max_new_tokens", "top_k", "seed", "best_of", "top_n_tokens", "truncate"])
def test_out_of_range_integers_tgi(hostile, name, value):
    params = {"max_new_tokens": 2, name: value}
    r = httpx.post(f"{hostile.url}/generate", json={"inputs": "a", "parameters": params}, timeout=60)
    if (name, value) in LEGAL_TGI:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, 422)


# seed is a u64; top_k and truncate (i64) clamp to what the model has.
LEGAL_TGI = {("seed", 2**63), ("seed", 2**32), ("top_k", 2**32), ("truncate", 2**32)}


@pytest.mark.parametrize("value", [2**64, 2**63, 2**32, -1, 0])
@pytest.mark.parametrize("name", ["max_tokens", "n", "seed", "logprobs", "top_k"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_range_integers_openai(hostile, route, name, value):
    base = {"prompt": "a"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}
    if route == "/v1/chat/completions" and name == "logprobs":
        name = "top_logprobs"
    r = httpx.post(hostile.url + route, json={**base, "max_tokens": 2, name: value}, timeout=60)
    legal = {("seed", 2**63), ("seed", 2**32), ("seed", 0), ("logprobs", 0), ("top_logprobs", 0),
             ("top_k", 2**32)}  # seed is a u64; a top_k past the vocabulary keeps every token
    if (name, value) in legal:
        assert r.status_code in ((200, 400) if name == "top_logprobs" else (200,)), r.text
        return
    assert_error(r, 422)


def test_extreme_but_legal_values_generate(hostile):
    for params in ({"seed": 2**64 - 1, "do_sample": True}, {"top_k": 2**62, "do_sample": True},
                   {"truncate": 2**62}, {"temperature": 1e-30 + 1e-6}, {"top_p": 1e-30 + 1e-6},
                   {"repetition_penalty": 1e30, "max_new_tokens": 4}, {"min_p": 1.0}):
        r = httpx.post(f"{hostile.url}/generate", timeout=60,
                       json={"inputs": "hello", "parameters": {"max_new_tokens": 3, **params}})
        assert r.status_code == 200, (params, r.text)


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("count", [17, 5000])
def test_thousands_of_stop_sequences_are_422(hostile, route, count):
    stops = [f"stop{i}" for i in range(count)]
    body = {"/generate": {"inputs": "a", "parameters": {"stop": stops}},
            "/v1/completions": {"prompt": "a", "stop": stops},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "stop": stops}}[route]
    r = httpx.post(hostile.url + route, json=body, timeout=60)
    assert_error(r, 422, "validation")
    assert "stop" in error_message(r.json())


def test_long_and_odd_stop_sequences_still_generate(hostile):
    for stop in (["y" * 20_000] * 16, ["\u0301", "\ud7ff", "🦀" * 100], ["\n", " ", "a"]):
        r = httpx.post(f"{hostile.url}/generate", timeout=60,
                       json={"inputs": "hello", "parameters": {"max_new_tokens": 20, "stop": stop, "details": True}})
        assert r.status_code == 200, r.text
        assert r.json()["details"]["generated_tokens"] <= 20
    r = httpx.post(f"{hostile.url}/generate", timeout=60, json={"inputs": "a", "parameters": {"stop": [""]}})
    assert_error(r, 422, "validation")


def _prompt_of(server, n: int) -> str:
    text = "hello" + " hello" * (n - 1)
    tokens = httpx.post(f"{server.url}/tokenize", json={"inputs": text}, timeout=60).json()
    assert len(tokens) == n, f"the prompt is {len(tokens)} tokens, wanted {n}"
    return text


def test_prompt_exactly_at_the_limits(hostile):
    at = _prompt_of(hostile, MAX_INPUT)
    path, body = "/generate", {"inputs": at, "parameters": {"max_new_tokens": MAX_TOTAL - MAX_INPUT,
                                                             "ignore_eos_token": True, "details": True}}
    r = httpx.post(hostile.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] == MAX_TOTAL - MAX_INPUT
    # Without max_new_tokens the default is cut to what fits.
    r = httpx.post(f"{hostile.url}/generate", json={"inputs": at, "parameters": {"details": True}}, timeout=60)
    assert r.status_code == 200 and r.json()["details"]["generated_tokens"] <= MAX_TOTAL - MAX_INPUT
    r = httpx.post(f"{hostile.url}/v1/completions", json={"prompt": at, "max_tokens": MAX_TOTAL - MAX_INPUT},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == MAX_INPUT


def test_prompt_one_over_the_limits(hostile):
    at, over = _prompt_of(hostile, MAX_INPUT), _prompt_of(hostile, MAX_INPUT + 1)
    cases = [
        ("/generate", {"inputs": over, "parameters": {"max_new_tokens": 1}}, "inputs"),
        ("/generate", {"inputs": at, "parameters": {"max_new_tokens": MAX_TOTAL - MAX_INPUT + 1}}, "max_new_tokens"),
        ("/generate_stream", {"inputs": over, "parameters": {"max_new_tokens": 1}}, "inputs"),
        ("/v1/completions", {"prompt": over, "max_tokens": 1}, "inputs"),
        ("/v1/completions", {"prompt": at, "max_tokens": MAX_TOTAL - MAX_INPUT + 1}, "max_new_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": over}], "max_tokens": 1}, "inputs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 2000}, "inputs"),
    ]
    for route, body, needle in cases:
        r = httpx.post(hostile.url + route, json=body, timeout=60)
        assert_error(r, 422, "validation")
        assert needle in error_message(r.json()), (route, r.text)
    # `truncate` keeps the last tokens: the same prompt is fine then.
    r = httpx.post(f"{hostile.url}/generate", timeout=60,
                   json={"inputs": over * 100, "parameters": {"max_new_tokens": 2, "truncate": MAX_INPUT}})
    assert r.status_code == 200, r.text


def test_too_many_prompts_in_one_completion_is_422_not_429(hostile):
    # 129 prompts can never fit 128 concurrency permits: retrying would not help.
    r = httpx.post(f"{hostile.url}/v1/completions", json={"prompt": ["a"] * 129, "max_tokens": 1}, timeout=60)
    assert_error(r, 422, "validation")
    r = httpx.post(f"{hostile.url}/v1/completions", json={"prompt": ["a"] * 8, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


@pytest.mark.parametrize("messages,status", [
    ([], 422),
    ("not a list", 422),
    ([None], 422),
    ([[1]], 422),
    ([{"content": "no role"}], 422),
    ([{"role": 5, "content": "a"}], 422),
    ([{"role": "user", "content": 5}], 422),
    ([{"role": "user", "content": {"a": 1}}], 422),
    ([{"role": "user", "content": [1, 2]}], 422),
    ([{"role": "user", "content": [{"type": "video", "url": "x"}]}], 422),
    ([{"role": "user", "content": [{"type": "text"}]}], 422),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}], 422),
    ([{"role": "user", "content": "a", "name": ["x"]}], 422),
    ([{"role": "user", "content": "a", "tool_call_id": 7}], 422),
    # Odd but well-formed: the template renders them (or raises its own 422).
    ([{"role": "user"}], (200, 422)),
    ([{"role": "user", "content": None}], (200, 422)),
    ([{"role": "banana", "content": "a"}], 422),  # roles outside OpenAI's set
    ([{"role": "", "content": ""}], 422),
    ([{"role": "user", "content": "a", "nickname": "x"}], 422),  # unknown message fields
    ([{"role": "assistant", "content": "a"}], (200, 422)),
    ([{"role": "tool", "content": "a", "tool_call_id": "x"}], (200, 422)),
    ([{"role": "user", "content": "a", "tool_calls": {"x": [1, {"y": None}]}}], (200, 422)),
    ([{"role": "user", "content": "{{ 7 * 7 }}{% raise %}{# #}"}], 200),
    ([{"role": "user", "content": "\u0000\u202e\ufeff\uffff"}], 200),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], 200),
])
def test_malformed_chat_messages(hostile, messages, status):
    r = httpx.post(f"{hostile.url}/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 2})
    allowed = tuple(400 if s == 422 else s for s in (status if isinstance(status, tuple) else (status,)))
    assert r.status_code in allowed, (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert_error(r, r.status_code)


@pytest.mark.parametrize("extra", [
    {"chat_template_kwargs": {"messages": 5, "add_generation_prompt": "x", "bos_token": [1]}},
    {"chat_template_kwargs": {"x": json.loads("[" * 100 + "]" * 100)}},
    {"tools": "x" * 10_000},
    {"tools": [{"type": "function", "function": {"name": 5}}]},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "banana"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}},
    {"response_format": {"type": "json_object", "value": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"response_format": {"type": "regex", "value": "a{100000}"}},
    {"response_format": {"type": "regex", "value": "(?=a)b"}},
    {"response_format": {"type": "lark", "value": "x"}},
    {"response_format": "json"},
    {"stream": "yes"},
    {"stream_options": {"include_usage": "no"}},
    {"model": ["x"]},
])
def test_malformed_chat_extras_are_4xx_or_work(hostile, extra):
    r = httpx.post(f"{hostile.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, **extra})
    assert r.status_code in (200, 400), (r.status_code, r.text[:300])
    if r.status_code == 400:
        assert_error(r, 422)


def test_broken_template_at_render_time_is_422(tiny_model_dir, tmp_path):
    # A template that compiles but fails on these messages: errors are values.
    import shutil

    for f in tiny_model_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}"
        "{{ m.content.upper() }}{{ m.missing.deeper }}{% endfor %}")
    s = launch(str(tmp_path), "--kv-cache-memory", "64MiB")
    try:
        for messages in ([{"role": "user", "content": "boom"}], [{"role": "user", "content": "a"}]):
            r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60)
            assert r.status_code in (200, 400), r.text
            if r.status_code == 400:
                assert_error(r, 422, "validation")
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "boom"}]},
                       timeout=60)
        assert_error(r, 422, "validation")
        assert "no boom here" in error_message(r.json())
        path, body = request("generate", 1, 3)
        r = httpx.post(s.url + path, json=body, timeout=60)
        check("generate", 3, r.status_code, r.content)
    finally:
        s.stop()


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
def test_wrong_methods_are_4xx_json(hostile, method):
    r = httpx.request(method, f"{hostile.url}/generate", timeout=30)
    assert 400 <= r.status_code < 500
    assert r.json()["error_type"]


def test_odd_headers_and_content_types(hostile):
    ok = json.dumps({"inputs": "a", "parameters": {"max_new_tokens": 2}}).encode()
    # The body is JSON whatever the client claims, as TGI reads it.
    assert raw(hostile, "/generate", ok, ctype="text/plain").status_code == 200
    assert_error(raw(hostile, "/generate", b"inputs=a", ctype="application/x-www-form-urlencoded"), 422)
    r = httpx.post(f"{hostile.url}/generate", content=ok, timeout=30,
                   headers={"content-type": "application/json", "x-junk": "a" * 8000})
    assert r.status_code == 200
