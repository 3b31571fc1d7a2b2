"""Tool calling on /v1/chat/completions with the unmodified `openai` client.

One tiny random-weight model server. Its chat template is Hermes-style
(`<tool_call>` in the template, so the server picks the Hermes parser) and
renders tools, assistant tool calls and tool results. With random weights
only grammar-forced calls parse: `tool_choice="required"` and a named
function are what these tests rely on; their arguments are checked against
the function's JSON schema.
"""

import json
import shutil

import jsonschema
import openai
import pytest

from server import launch

EOS = 2
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n"
    "{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                       "required": ["a", "b"], "additionalProperties": False},
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-tools")
    shutil.copytree(tiny_model_dir, model, dirs_exist_ok=True)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return model


@pytest.fixture(scope="module")
def client(model_dir):
    s = launch(str(model_dir), "--kv-cache-memory", "64MiB", "--max-input-tokens", "768", "--max-total-tokens", "1024")
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
    s.stop()


def assert_valid(call):
    assert call.id.startswith("call_") and call.type == "function"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_call_parses_and_validates(client):
    # One call: with parallel calls, random weights go on calling until max_tokens cuts the last one
    # (which then stays content, see test_parallel_tool_calls).
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=96, temperature=0, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and choice.message.content is None
    for call in choice.message.tool_calls:
        assert_valid(call)


def test_named_function_is_the_one_called(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=96, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "add"}},
                                       parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"] and r.choices[0].finish_reason == "tool_calls"
    assert set(assert_valid(calls[0])) == {"a", "b"}


def test_streamed_calls_match_the_plain_ones(client):
    args = dict(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0)
    plain = client.chat.completions.create(**args).choices[0].message.tool_calls
    calls, fragments, finish = {}, {}, None
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    # OpenAI's shape: the first delta of a call names it, with empty arguments.
                    assert d.id.startswith("call_") and d.type == "function" and d.function.name, d
                    assert d.function.arguments == "", d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                    continue
                # Later deltas carry only fragments of the arguments.
                assert d.id is None and d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments
                fragments[d.index] = fragments.get(d.index, 0) + 1
            finish = choice.finish_reason or finish
    streamed = [c for _, c in sorted(calls.items())]
    # finish_reason "length" says the last call was cut short.
    assert finish == ("tool_calls" if len(streamed) == len(plain) else "length")
    # Random weights go on calling until max_tokens cuts a call short. The plain reply returns that
    # text as content; the stream had already sent the call, which keeps the arguments it got.
    assert len(streamed) in (len(plain), len(plain) + 1), (streamed, plain)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed[: len(plain)]] == [
        (c.function.name, json.loads(c.function.arguments)) for c in plain]
    if len(streamed) > len(plain):
        with pytest.raises(json.JSONDecodeError):
            json.loads(streamed[-1]["arguments"])
    # The arguments arrive as they are generated (about a token a chunk), not whole at the end.
    assert all(n > 3 for n in list(fragments.values())[: len(plain)]) and len(fragments) == len(calls), fragments


def test_parallel_tool_calls(client):
    # EOS biased away: the grammar lets the reply go on with more calls only when parallel calls are allowed.
    args = dict(model="m", messages=ASK, tools=[ADD], tool_choice="required", max_tokens=80, temperature=0,
                logit_bias={str(EOS): -100})
    many = client.chat.completions.create(**args).choices[0].message.tool_calls
    one = client.chat.completions.create(**args, parallel_tool_calls=False).choices[0].message.tool_calls
    assert len(many) >= 2 and len(one) == 1
    # The call max_tokens cut short is not a call: it stays content.
    for c in many + one:
        assert_valid(c)
    assert len({c.id for c in many}) == len(many)


def test_two_turns_with_a_tool_result(client, model_dir):
    from transformers import AutoTokenizer

    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=96, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           parallel_tool_calls=False)
    assert first.choices[0].message.content is None
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=5, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length")
    # The prompt is what transformers renders from the same history (arguments as an object, as templates expect).
    tok = AutoTokenizer.from_pretrained(model_dir)
    fn = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
    ref = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": fn}]},
           {"role": "tool", "content": '{"temperature": 21}'}]
    text = tok.apply_chat_template(ref, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\n{\"temperature\": 21}" in text and call.function.name in text
    assert second.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])


def test_tool_choice_none_and_bad_choices(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4,
                                       temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=ASK, max_tokens=4, tool_choice="required")


# --- how many calls: named, required, parallel_tool_calls; streamed and whole alike ----------------

def calls_of(client, **args) -> tuple[list, list, str, str]:
    """(name, arguments) of each call, whole and streamed, and both finish reasons."""
    r = client.chat.completions.create(**args)
    whole = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls or []]
    streamed, finish = {}, None
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = streamed.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    def parsed(arguments: str):  # a call max_tokens cut short keeps the text it got
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments

    streamed = [(c["name"], parsed(c["arguments"])) for _, c in sorted(streamed.items())]
    return whole, streamed, r.choices[0].finish_reason, finish


# EOS biased away: the reply ends after one call only where the grammar allows nothing else.
NO_EOS = {str(EOS): -100}


@pytest.mark.parametrize("parallel", [None, True, False])
def test_a_named_function_is_called_exactly_once(client, parallel):
    args = dict(model="m", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0, logit_bias=NO_EOS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if parallel is not None:
        args["parallel_tool_calls"] = parallel
    whole, streamed, finish, streamed_finish = calls_of(client, **args)
    assert [name for name, _ in whole] == ["get_weather"], whole
    assert whole == streamed and finish == streamed_finish == "tool_calls"
    jsonschema.validate(whole[0][1], SCHEMAS["get_weather"])


def test_required_calls_at_least_once_and_once_without_parallel_calls(client):
    base = dict(model="m", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0, tool_choice="required")
    whole, streamed, finish, _ = calls_of(client, **base, logit_bias=NO_EOS, parallel_tool_calls=False)
    assert len(whole) == 1 and whole == streamed and finish == "tool_calls"
    whole, streamed, finish, streamed_finish = calls_of(client, **base)
    assert len(whole) >= 1 and whole == streamed[: len(whole)] and finish in ("tool_calls", "length")


STRICT = {"type": "function", "function": {"name": "note", "strict": True, "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 8},
                                     "tags": {"type": "array", "maxItems": 2, "items": {
                                         "type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99}}}}}}}}


def test_strict_schemas_allow_no_other_keys(client):
    """Sampled (random weights write whatever the grammar lets them): every call's arguments, and
    each object inside them, hold only the keys the strict schema lists."""
    closed = json.loads(json.dumps(STRICT["function"]["parameters"]))
    closed["additionalProperties"] = False
    closed["properties"]["tags"]["items"]["additionalProperties"] = False
    r = client.chat.completions.create(model="m", messages=ASK, tools=[STRICT], tool_choice="required", n=4,
                                       temperature=1.5, seed=7, max_tokens=200, parallel_tool_calls=False)
    calls = [c for choice in r.choices for c in choice.message.tool_calls or []]
    assert len(calls) >= 3, r.choices
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), closed)
