"""Anthropic Messages API (`POST /v1/messages`) with the unmodified
`anthropic` client: plain, streamed, tools (forced, so random weights make
parseable calls), a tool result in the history, stop sequences, the
`x-api-key` / Bearer keys, and Anthropic's error shape.

One tiny random-weight model server with the Hermes-style tool template of
test_tools.py and an API key.
"""

import json
import shutil

import anthropic
import httpx
import jsonschema
import pytest

from server import launch
from test_tools import ADD, TEMPLATE, WEATHER

KEY = "sk-test-anthropic"
TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
          "input_schema": t["function"]["parameters"]} for t in (WEATHER, ADD)]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Recent `anthropic` clients have no `temperature` argument; the server honours the field.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-anthropic")
    shutil.copytree(tiny_model_dir, model, dirs_exist_ok=True)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    s = launch(str(model), "--kv-cache-memory", "64MiB", "--max-input-tokens", "768", "--max-total-tokens", "1024",
               env={"PAGEMILL_API_KEY": KEY})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60)


def test_plain_message(client):
    m = client.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=ASK, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert 0 < m.usage.output_tokens <= 12 and m.usage.input_tokens > 0
    assert all(b.type == "text" for b in m.content)


def test_streamed_text_equals_plain(client):
    args = dict(model="tiny", max_tokens=12, messages=ASK, extra_body=GREEDY)
    plain = client.messages.create(**args)
    with client.messages.stream(**args) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "".join(b.text for b in plain.content)
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


def test_stop_sequences(client):
    full = "".join(b.text for b in client.messages.create(model="tiny", max_tokens=24, messages=ASK,
                                                          extra_body=GREEDY).content)
    assert len(full) >= 6, full
    stop = full[len(full) // 2: len(full) // 2 + 3]
    m = client.messages.create(model="tiny", max_tokens=24, messages=ASK, extra_body=GREEDY, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence"
    assert "".join(b.text for b in m.content) == full[: full.index(stop)]


def test_forced_tool_use_plain_and_streamed(client):
    args = dict(model="tiny", max_tokens=96, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                tool_choice={"type": "tool", "name": "get_weather"})
    m = client.messages.create(**args)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, SCHEMAS["get_weather"])
    with client.messages.stream(**args) as s:
        fragments = {}
        for e in s:
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
                fragments.setdefault(e.index, []).append(e.delta.partial_json)
        final = s.get_final_message()
    # The input arrives as it is generated, in fragments the client joins (first block: random
    # weights may go on calling until max_tokens cuts one short).
    first = fragments[min(fragments)]
    assert len(first) > 3 and json.loads("".join(first)) == uses[0].input
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed[: len(uses)]] == [(b.name, b.input) for b in uses]
    # A call max_tokens cut short: the plain reply keeps it as text; the stream had sent it, and says
    # the reply was cut (stop_reason max_tokens), so the client knows its input is incomplete.
    assert len(streamed) in (len(uses), len(uses) + 1)
    assert final.stop_reason == ("tool_use" if len(streamed) == len(uses) else "max_tokens")


def test_any_tool_then_a_tool_result(client):
    first = client.messages.create(model="tiny", max_tokens=96, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and first.stop_reason == "tool_use"
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                   "content": "21 degrees"}]}]
    second = client.messages.create(model="tiny", max_tokens=5, messages=history, tools=TOOLS, extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.usage.input_tokens > first.usage.input_tokens


def test_errors_have_anthropic_shape(client, srv):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=0, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "wizard", "content": "hi"}])
    r = httpx.post(f"{srv.url}/v1/messages", json={"model": "t", "max_tokens": 4, "messages": ASK, "bogus": 1},
                   headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=ASK)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}
    # The same key as a Bearer token works too.
    r = httpx.post(f"{srv.url}/v1/messages", json={"model": "t", "max_tokens": 2, "messages": ASK},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["type"] == "message"


# --- every field of the request schema is honoured (or rejected, above) ------------------------------

def _fields(srv, schema: str) -> set[str]:
    spec = httpx.get(f"{srv.url}/openapi.json", timeout=10).json()
    return set(spec["components"]["schemas"][schema]["properties"])


def _raw(srv, **fields) -> dict:
    body = {"model": "tiny", "max_tokens": 8, "messages": ASK, "temperature": 0, **fields}
    r = httpx.post(f"{srv.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200, (fields, r.text)
    return r.json() if not fields.get("stream") else {"events": r.text}


def _text(out: dict) -> str:
    return "".join(b.get("text", "") for b in out["content"])


def _sampled_equals_greedy(**knob):
    def check(srv):
        greedy = [_text(_raw(srv, max_tokens=16)) for _ in range(1)][0]
        sampled = [_text(_raw(srv, max_tokens=16, temperature=1.0, **knob)) for _ in range(3)]
        assert all(s == greedy for s in sampled), (greedy, sampled)

    return check


LONGER = "What is the weather in Paris, in Rome and in Oslo today?"
MESSAGES_FIELDS = {
    "model": lambda srv: _raw(srv, model="other")["model"] == "other" or pytest.fail(),
    "max_tokens": lambda srv: _raw(srv, max_tokens=1)["usage"]["output_tokens"] == 1 or pytest.fail(),
    "messages": lambda srv: (_raw(srv, messages=[{"role": "user", "content": LONGER}])["usage"]["input_tokens"]
                             > _raw(srv)["usage"]["input_tokens"]) or pytest.fail(),
    "system": lambda srv: (_raw(srv, system="Be brief.")["usage"]["input_tokens"]
                           > _raw(srv)["usage"]["input_tokens"]) or pytest.fail(),
    "stop_sequences": lambda srv: test_stop_sequences(anthropic.Anthropic(base_url=srv.url, api_key=KEY,
                                                                          max_retries=0)),
    "stream": lambda srv: "event: message_stop" in _raw(srv, stream=True)["events"] or pytest.fail(),
    "temperature": lambda srv: len({_text(_raw(srv, max_tokens=16, temperature=1.0)) for _ in range(3)}) > 1
    or pytest.fail("temperature 1 sampled the same text three times"),
    "top_p": _sampled_equals_greedy(top_p=1e-6),
    "top_k": _sampled_equals_greedy(top_k=1),
    "tools": lambda srv: (_raw(srv, tools=TOOLS)["usage"]["input_tokens"] > _raw(srv)["usage"]["input_tokens"])
    or pytest.fail(),
    "tool_choice": lambda srv: _raw(srv, tools=TOOLS, max_tokens=96, tool_choice={"type": "any"})["stop_reason"]
    == "tool_use" or pytest.fail(),
    # A label (docs/api.md): accepted, no effect.
    "metadata": lambda srv: _text(_raw(srv, metadata={"user_id": "u-1"})) == _text(_raw(srv)) or pytest.fail(),
}


def test_every_request_field_is_honoured_or_rejected(srv):
    fields = _fields(srv, "MessagesRequest")
    assert not fields - set(MESSAGES_FIELDS), f"fields without a check: {sorted(fields - set(MESSAGES_FIELDS))}"
    failed = []
    for name in sorted(fields):
        try:
            MESSAGES_FIELDS[name](srv)
        except (AssertionError, pytest.fail.Exception) as e:
            failed.append(f"{name}: {e}")
    assert not failed, failed
