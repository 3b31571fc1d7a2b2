"""OpenAI Responses API (`POST /v1/responses`, stateless) with the
unmodified `openai` client's `client.responses.create`: plain text input,
message items with instructions, streamed typed events, and a function
tool (forced, so random weights make a parseable call) followed by its
output in a second request.

One tiny random-weight model server with the Hermes-style tool template of test_tools.py.
"""

import json
import shutil

import jsonschema
import openai
import pytest

from server import launch
from test_tools import ADD, TEMPLATE, WEATHER

TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
          "parameters": t["function"]["parameters"]} for t in (WEATHER, ADD)]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-responses")
    shutil.copytree(tiny_model_dir, model, dirs_exist_ok=True)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    s = launch(str(model), "--kv-cache-memory", "64MiB", "--max-input-tokens", "768", "--max-total-tokens", "1024")
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
    s.stop()


def test_plain_text_input(client):
    r = client.responses.create(model="tiny", input="Say hello.", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.id.startswith("resp")
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.output_text == r.output[0].content[0].text
    assert 0 < r.usage.output_tokens <= 8
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 8


def test_instructions_and_items_reach_the_prompt(client):
    plain = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, temperature=0)
    more = client.responses.create(model="tiny", instructions="You are terse.", max_output_tokens=2, temperature=0,
                                   input=[{"role": "developer", "content": "Answer in French."},
                                          {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert more.usage.input_tokens > plain.usage.input_tokens
    assert more.instructions == "You are terse."


def test_streamed_events_build_the_same_text(client):
    args = dict(model="tiny", input="Tell me a story.", max_output_tokens=10, temperature=0)
    plain = client.responses.create(**args)
    types, deltas, final = [], "", None
    for event in client.responses.create(**args, stream=True):
        types.append(event.type)
        if event.type == "response.output_text.delta":
            deltas += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in types and "response.output_text.done" in types
    assert deltas == plain.output_text == final.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_function_tool_call_then_its_output(client):
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, max_output_tokens=96,
                                    temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])
    # Streamed, the same call arrives as typed events.
    streamed = None
    for event in client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, max_output_tokens=96,
                                         temperature=0, tool_choice={"type": "function", "name": "get_weather"},
                                         stream=True):
        if event.type == "response.function_call_arguments.done":
            streamed = event.arguments
    assert json.loads(streamed) == json.loads(calls[0].arguments)
    # Stateless: the client sends the call and its output back.
    second = client.responses.create(model="tiny", tools=TOOLS, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name, "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 degrees"}])
    assert second.output[0].type == "message" and second.usage.input_tokens > first.usage.input_tokens


def test_errors_are_openai_shaped(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", store=True)
    assert "store" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert "previous_response_id" in str(e.value)
