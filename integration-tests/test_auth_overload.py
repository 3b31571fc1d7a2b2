"""`--api-key` (401), `--max-concurrent-requests` (429) and a broken chat
template (422), on a tiny random model that starts in seconds."""

import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import pagemill_client
from server import HOLD_ARGS, HOLD_TOKENS, error_code, launch

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def locked(tiny_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-broken-template")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, model / f.name)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content ")
    s = launch(str(model), "--kv-cache-memory", "64MiB", "--api-key", KEY, "--max-concurrent-requests", "2",
               *HOLD_ARGS, "--max-input-tokens", "1024")
    yield s
    s.stop()


@pytest.mark.parametrize("path,body", [
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("/", {"inputs": "hi"}),
    ("/tokenize", {"inputs": "hi"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_generation_routes_need_the_key(locked, path, body, headers):
    r = httpx.post(locked.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    assert error_code(r.json()) == "unauthorized"


def test_key_opens_generation_and_ops_stay_open(locked):
    r = httpx.post(f"{locked.url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                   headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{locked.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{locked.url}/v1/models", headers=AUTH, timeout=10).status_code == 200
    for path in ("/health", "/metrics", "/info", "/openapi.json"):
        assert httpx.get(locked.url + path, timeout=10).status_code == 200, path
    assert locked.info()["api_key_required"] is True
    # The launcher hands the key to the router in its environment, not on its command line.
    routers = [argv for argv in _cmdlines() if "router" in argv and str(locked.port) in argv]
    assert routers and all(KEY not in argv for argv in routers)


def _cmdlines():
    import pathlib

    for p in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            yield p.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue


def test_clients_raise_authentication_errors(locked):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{locked.url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="x", prompt="hi", max_tokens=2)
    with pytest.raises(pagemill_client.AuthenticationError):
        pagemill_client.Client(locked.url, api_key="wrong").generate("hi", max_new_tokens=2)
    ok = pagemill_client.Client(locked.url, api_key=KEY).generate("hi", max_new_tokens=2)
    assert ok.generated_text is not None


def test_broken_chat_template_is_400_and_generate_still_works(locked):
    r = httpx.post(f"{locked.url}/v1/chat/completions", headers=AUTH, timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "validation" and "template" in r.json()["error"]["message"]
    assert locked.info()["has_chat_template"] is False


def test_overload_beyond_max_concurrent_requests_is_429(locked):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 1500, "ignore_eos_token": True}}

    def post(_):
        return httpx.post(f"{locked.url}/generate", json=body, headers=AUTH, timeout=300)

    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(post, range(6)))
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 2 and 429 in codes, codes
    assert set(codes) <= {200, 429}
    for r in responses:
        if r.status_code == 429:
            assert r.json()["error_type"] == "overloaded"


def test_sdk_and_openai_raise_overloaded(locked):
    long = {"inputs": "hello", "parameters": {"max_new_tokens": HOLD_TOKENS, "ignore_eos_token": True}}
    with httpx.Client(timeout=300) as http:
        streams = [http.stream("POST", f"{locked.url}/generate_stream", json=long, headers=AUTH) for _ in range(2)]
        opened = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in opened)
            with pytest.raises(pagemill_client.OverloadedError):
                pagemill_client.Client(locked.url, api_key=KEY).generate("hi", max_new_tokens=2)
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=f"{locked.url}/v1", api_key=KEY, max_retries=0).completions.create(
                    model="x", prompt="hi", max_tokens=2)
        finally:
            for s in streams:
                s.__exit__(None, None, None)
