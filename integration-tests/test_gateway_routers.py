"""Two pagemill servers behind the real routers users put in front of many
servers: vLLM's `vllm-router` and SGLang's gateway (`sglang-router`), the
PyPI wheels of the `test` extra, both with their `cache_aware` policy. The
unmodified `openai` client goes through each router (completions, chat,
streaming, a tool call, n > 1) and gets what the servers answer directly;
nothing is mocked. The routers add their own fields to every request and
call vLLM's render and SGLang's info routes; the servers' counters show
those were answered.

One pair of servers (a tiny random-weight model with a Hermes tool template,
as in test_tools.py: with random weights only grammar-forced calls parse) is
shared by both routers.
"""

import json
import re
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from gateway_routers import start_router
from server import launch
from test_tools import ADD, TEMPLATE, WEATHER

ROUTERS = ["vllm-router", "sglang-router"]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
DOCS = Path(__file__).parent.parent / "docs" / "metrics.md"


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-gateway")
    shutil.copytree(tiny_model_dir, model, dirs_exist_ok=True)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    args = ("--kv-cache-memory", "64MiB", "--max-input-tokens", "768", "--max-total-tokens", "1024")
    pair = [launch(str(model), *args), launch(str(model), *args)]
    yield pair
    for s in pair:
        s.stop()


@pytest.fixture(scope="module")
def model_id(servers):
    return servers[0].info()["model_id"]


@pytest.fixture(scope="module")
def direct(servers):
    return openai.OpenAI(base_url=f"{servers[0].url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module", params=ROUTERS)
def router(request, servers, model_id):
    r = start_router(request.param, [s.url for s in servers], model_id)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def routed(router):
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions(routed, direct, model_id):
    args = dict(model=model_id, prompt="Once upon a time", max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    got, want = routed.completions.create(**args), direct.completions.create(**args)
    assert got.choices[0].text == want.choices[0].text and got.usage.completion_tokens == 12


def test_chat(routed, direct, model_id):
    args = dict(model=model_id, messages=ASK, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    got, want = routed.chat.completions.create(**args), direct.chat.completions.create(**args)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.completion_tokens == 12


def test_streaming_chat(routed, direct, model_id):
    args = dict(model=model_id, messages=ASK, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(routed.chat.completions.create(**args, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 12 and text == direct.chat.completions.create(**args).choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_tool_call(routed, direct, model_id, tool_choice):
    args = dict(model=model_id, messages=ASK, tools=[WEATHER, ADD], tool_choice=tool_choice, temperature=0,
                max_tokens=80)
    got, want = routed.chat.completions.create(**args), direct.chat.completions.create(**args)
    calls = lambda r: [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
    assert got.choices[0].finish_reason == "tool_calls" and calls(got) == calls(want) and calls(got)
    if isinstance(tool_choice, dict):
        assert {name for name, _ in calls(got)} == {"add"}


def test_n_choices(routed, direct, model_id):
    args = dict(model=model_id, messages=ASK, max_tokens=8, n=2, temperature=1.0, seed=7,
                extra_body={"ignore_eos": True})
    got, want = routed.chat.completions.create(**args), direct.chat.completions.create(**args)
    texts = lambda r: [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts(got) == texts(want) and len(set(texts(got))) == 2
    cmpl = dict(model=model_id, prompt="Once upon a time", max_tokens=8, n=2, temperature=1.0, seed=7)
    got, want = routed.completions.create(**cmpl), direct.completions.create(**cmpl)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]


def answered(servers, route: str) -> int:
    """200s the servers gave on `route` (pagemill_http_requests_total)."""
    total = 0
    for s in servers:
        text = httpx.get(f"{s.url}/metrics", timeout=10).text
        m = re.search(rf'^pagemill_http_requests_total{{route="{re.escape(route)}",status="200"}} (\d+)', text, re.M)
        total += int(m.group(1)) if m else 0
    return total


def test_the_routers_own_calls_were_answered(servers, router):
    """vllm-router renders every request first; SGLang's gateway read the info routes at registration."""
    if router.name == "vllm-router":
        assert answered(servers, "/v1/chat/completions/render") > 0
        assert answered(servers, "/v1/completions/render") > 0
    else:
        assert answered(servers, "/server_info") > 0 and answered(servers, "/model_info") > 0
    for route in ("/v1/chat/completions", "/v1/completions"):
        errors = [line for s in servers for line in httpx.get(f"{s.url}/metrics", timeout=10).text.splitlines()
                  if line.startswith(f'pagemill_http_requests_total{{route="{route}",status="4')]
        assert not errors, errors


def test_every_exposed_metric_is_documented(servers):
    docs = DOCS.read_text()
    text = httpx.get(f"{servers[0].url}/metrics", timeout=10).text
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "sglang:num_queue_reqs"} <= set(families)
    missing = [f for f in families if f"`{f}`" not in docs]
    assert not missing, f"not in docs/metrics.md: {missing}"
