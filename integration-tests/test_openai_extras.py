"""OpenAI routes, strictly: token-id prompts, vLLM's extra sampling fields,
logit_bias, roles, unknown fields and OpenAI's error shape, with the
unmodified `openai` client; then a walk over every field of both request
schemas in /openapi.json, each shown honoured by its effect on the output.

One tiny random-weight model server for the module. Its chat template
renders `tools` and a `greeting` variable, so the fields that only reach the
template have a visible effect. EOS is token 2 (conftest's tiny config);
`logit_bias` +100 on it makes the greedy output end at once unless told not to.
"""

import json
import shutil

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from server import launch

EOS = 2
FORCE_EOS = {str(EOS): 100}
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% if greeting %}{{ greeting }}\n{% endif %}"
    "{% if reasoning_effort %}Effort: {{ reasoning_effort }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-template")
    shutil.copytree(tiny_model_dir, model, dirs_exist_ok=True)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    s = launch(str(model), "--kv-cache-memory", "64MiB", "--max-input-tokens", "256", "--max-total-tokens", "512")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def post(srv, route: str, **body) -> httpx.Response:
    return httpx.post(f"{srv.url}{route}", json=body, timeout=60)


# --- token-id prompts ---------------------------------------------------------------------------

def test_token_id_prompts_single_and_batch(client, srv, tok):
    ids = [t["id"] for t in post(srv, "/tokenize", inputs="The sky is blue and").json()]
    text = client.completions.create(model="x", prompt="The sky is blue and", temperature=0, max_tokens=6)
    one = client.completions.create(model="x", prompt=ids, temperature=0, max_tokens=6)
    assert one.choices[0].text == text.choices[0].text
    assert one.usage.prompt_tokens == len(ids)
    other = [504, 6102, 314]
    alone = client.completions.create(model="x", prompt=other, temperature=0, max_tokens=6)
    batch = client.completions.create(model="x", prompt=[ids, other], temperature=0, max_tokens=6)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [one.choices[0].text, alone.choices[0].text]
    assert batch.usage.prompt_tokens == len(ids) + len(other)
    echo = client.completions.create(model="x", prompt=other, temperature=0, max_tokens=2, echo=True)
    two = client.completions.create(model="x", prompt=other, temperature=0, max_tokens=2)
    assert echo.choices[0].text == tok.decode(other, skip_special_tokens=False) + two.choices[0].text
    streamed = client.completions.create(model="x", prompt=[other], temperature=0, max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == alone.choices[0].text


@pytest.mark.parametrize("prompt", [[[]], [10**9], [-1], [[1], ["a"]]])
def test_bad_token_id_prompts_are_400_naming_prompt(client, prompt):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt=prompt, max_tokens=2)
    assert e.value.param == "prompt", e.value.body


# --- vLLM's extra fields ------------------------------------------------------------------------

def test_ignore_eos_gives_exactly_max_tokens(client):
    out = client.completions.create(model="x", prompt="hi", temperature=0, max_tokens=7, logit_bias=FORCE_EOS)
    assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model="x", prompt="hi", temperature=0, max_tokens=7, logit_bias=FORCE_EOS,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model="x", messages=MESSAGES, temperature=0, max_tokens=7, logit_bias=FORCE_EOS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 7


def test_min_tokens_holds_eos_back(client):
    out = client.completions.create(model="x", prompt="hi", temperature=0, max_tokens=20, logit_bias=FORCE_EOS,
                                    extra_body={"min_tokens": 5})
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt="hi", max_tokens=4, extra_body={"min_tokens": 5})
    assert e.value.param == "min_tokens"


def test_stop_token_ids(client, tok):
    force = {"504": 100}
    out = client.completions.create(model="x", prompt="hi", temperature=0, max_tokens=4, logit_bias=force)
    assert out.usage.completion_tokens == 4 and out.choices[0].text == tok.decode([504] * 4)
    out = client.completions.create(model="x", prompt="hi", temperature=0, max_tokens=4, logit_bias=force,
                                    extra_body={"stop_token_ids": [504]})
    assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "stop"
    # Held back by min_tokens like EOS: three other tokens, then 504 stops.
    out = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=8, logit_bias=force,
                                         extra_body={"stop_token_ids": [504], "min_tokens": 3})
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt="hi", max_tokens=4, extra_body={"stop_token_ids": [10**9]})
    assert e.value.param == "stop_token_ids"


def test_logit_bias_forces_a_token_on_chat(client, tok):
    out = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=3,
                                         logit_bias={"504": 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == tok.decode([504] * 3)
    plain = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=3)
    assert plain.choices[0].message.content != out.choices[0].message.content


@pytest.mark.parametrize("bias", [{"abc": 1}, {"504": 101}, {"504": -100.5}, {str(10**9): 1}, {"-1": 1}])
def test_bad_logit_bias_is_400(client, bias):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=2, logit_bias=bias)
    assert e.value.param == "logit_bias", e.value.body


def test_prompt_logprobs_match_tgi_decoder_input_details(client, srv):
    out = client.completions.create(model="x", prompt="The sky is", max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 0})
    got = out.choices[0].model_extra["prompt_logprobs"]
    ref = post(srv, "/generate", inputs="The sky is",
               parameters={"max_new_tokens": 1, "decoder_input_details": True}).json()["details"]["prefill"]
    assert len(got) == len(ref) == out.usage.prompt_tokens and got[0] is None
    for entry, r in zip(got[1:], ref[1:]):
        assert list(entry) == [str(r["id"])]
        assert entry[str(r["id"])]["logprob"] == pytest.approx(r["logprob"], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt="a", max_tokens=1, extra_body={"prompt_logprobs": 6})
    assert e.value.param == "prompt_logprobs"  # more alternatives than --max-top-n-tokens (5)


# --- roles, unknown fields, error shape ----------------------------------------------------------

@pytest.mark.parametrize("role", ["wizard", "", "System"])
def test_roles_outside_the_api_are_400(client, role):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=[{"role": role, "content": "hi"}], max_tokens=2)
    assert e.value.param == "messages[0].role", e.value.body


def test_developer_role_is_rendered_as_system(client):
    def prompt_tokens(role):
        return client.chat.completions.create(model="x", max_tokens=1, temperature=0, messages=[
            {"role": role, "content": "Be brief."}, *MESSAGES]).usage.prompt_tokens

    assert prompt_tokens("developer") == prompt_tokens("system")


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "a", "frobnicate": 1}),
    ("/v1/chat/completions", {"messages": MESSAGES, "frobnicate": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a", "frobnicate": 1}]}),
])
def test_unknown_fields_are_400_naming_them(srv, route, body):
    r = post(srv, route, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].endswith("frobnicate") and "frobnicate" in r.json()["error"]["message"]


def test_openai_error_shape_for_a_bad_parameter(client, srv):
    r = post(srv, "/v1/chat/completions", messages=MESSAGES, top_p=5)
    assert r.status_code == 400
    body = r.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "top_p"
    assert "top_p" in body["error"]["message"] and body["error"]["code"] == "validation"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt="a", temperature=3)
    assert e.value.param == "temperature" and e.value.type == "invalid_request_error"
    # TGI's routes keep their own shape and status.
    r = post(srv, "/generate", inputs="a", parameters={"top_p": 5})
    assert r.status_code == 422 and set(r.json()) == {"error", "error_type"}


# --- every field of both request schemas ----------------------------------------------------------

def resolve(spec: dict, schema: dict) -> set[str]:
    """Property names of a schema, through $ref and allOf (utoipa writes flattened structs that way)."""
    if "$ref" in schema:
        return resolve(spec, spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]])
    names = set(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        names |= resolve(spec, part)
    return names


class Walk:
    """Requests against one route with a fixed base body; greedy and short by default."""

    def __init__(self, srv, route: str):
        self.srv, self.route = srv, route
        self.base = {"prompt": "Once upon a time"} if route == "/v1/completions" else {"messages": MESSAGES}

    def raw(self, **fields) -> httpx.Response:
        return post(self.srv, self.route, **{**self.base, "max_tokens": 8, "temperature": 0, **fields})

    def __call__(self, **fields) -> dict:
        r = self.raw(**fields)
        assert r.status_code == 200, (fields, r.text)
        return r.json()

    @staticmethod
    def text(out: dict, i: int = 0) -> str:
        c = out["choices"][i]
        return c["text"] if "text" in c else c["message"]["content"]


def _stop(w: Walk):
    full = w.text(w(ignore_eos=True, max_tokens=16))
    s = full[len(full) // 2 : len(full) // 2 + 3]
    assert s and w.text(w(ignore_eos=True, max_tokens=16, stop=[s])) == full[: full.index(s)]


def _penalty(name: str, value: float):
    def check(w: Walk):
        plain = w.text(w(ignore_eos=True, max_tokens=24))
        assert w.text(w(ignore_eos=True, max_tokens=24, **{name: value})) != plain

    return check


def _sampled_equals_greedy(**knob):
    def check(w: Walk):
        greedy = w.text(w(ignore_eos=True))
        sampled = dict(ignore_eos=True, temperature=1.5, seed=7)
        assert w.text(w(**sampled)) != greedy  # the knob below is what makes them equal
        assert w.text(w(**sampled, **knob)) == greedy

    return check


def _stream(w: Walk):
    r = w.raw(stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.rstrip().endswith("data: [DONE]")


def _stream_options(w: Walk):
    chunks = [json.loads(line[5:]) for line in w.raw(stream=True, stream_options={"include_usage": True},
                                                     ignore_eos=True).text.splitlines()
              if line.startswith("data:") and "[DONE]" not in line]
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and chunks[-1]["choices"] == []


def _prompt_tokens_grow(**fields):
    def check(w: Walk):
        assert w(**fields)["usage"]["prompt_tokens"] > w()["usage"]["prompt_tokens"]

    return check


NO_ARGS_TOOL = [{"type": "function", "function": {
    "name": "f", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]


def _parallel_tool_calls(w: Walk):
    # EOS biased away: after a forced call, only parallel calls let the reply go on with another.
    def calls(**more):
        out = w(tools=NO_ARGS_TOOL, tool_choice="required", max_tokens=64, logit_bias={str(EOS): -100}, **more)
        return len(out["choices"][0]["message"]["tool_calls"])

    assert calls() >= 2 and calls(parallel_tool_calls=False) == 1


def _seed(w: Walk):
    a, b, c = (w.text(w(temperature=1.0, seed=s, ignore_eos=True)) for s in (1, 1, 2))
    assert a == b != c


def _priority(w: Walk):
    # Its effect is on order (integration-tests/test_kv_scheduling.py); here: accepted, output unchanged,
    # and out of range is a 400 naming it.
    assert w.text(w(priority=-3)) == w.text(w())
    r = w.raw(priority=2**40)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text


def _labels_only(field: str, value):
    # Documented in docs/api.md: one model is served; `user` only matters with --max-running-per-tenant.
    def check(w: Walk):
        assert w.text(w(**{field: value})) == w.text(w())

    return check


SPECIAL = 1  # <|im_start|>, a special token of the tiny model's tokenizer


def _refused(w: Walk, field: str, **body):
    r = w.raw(**body)
    assert r.status_code == 400, (body, r.text)
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (field, "unsupported"), r.text


def _default_only(field: str, default, refused):
    """Fields of vLLM's and SGLang's servers accepted at their default (output unchanged), refused otherwise."""
    def check(w: Walk):
        assert w.text(w(**{field: default})) == w.text(w())
        _refused(w, field, **{field: refused})

    return check


def _keep_stop(field: str):
    def check(w: Walk):
        full = w.text(w(ignore_eos=True, max_tokens=16))
        s = full[len(full) // 2 : len(full) // 2 + 3]
        kept = w.text(w(ignore_eos=True, max_tokens=16, stop=[s], **{field: True}))
        assert kept == full[: full.index(s) + len(s)], (s, kept, full)

    return check


def _skip_special_tokens(w: Walk):
    forced = dict(logit_bias={str(SPECIAL): 100}, ignore_eos=True, max_tokens=3)
    assert w.text(w(**forced)) == ""
    assert w.text(w(**forced, skip_special_tokens=False)) == "<|im_start|>" * 3


def _spaces_between_special_tokens(w: Walk):
    forced = dict(logit_bias={str(SPECIAL): 100}, ignore_eos=True, max_tokens=3, skip_special_tokens=False)
    assert w.text(w(**forced, spaces_between_special_tokens=False)) == w.text(w(**forced))


def _sampling_seed(w: Walk):
    a, b, c = (w.text(w(temperature=1.0, sampling_seed=s, ignore_eos=True)) for s in (1, 1, 2))
    assert a == b != c and a == w.text(w(temperature=1.0, seed=1, ignore_eos=True))
    r = w.raw(seed=1, sampling_seed=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_seed", r.text


def _reasoning_field(field: str, value):
    # Its effect needs --reasoning-parser (integration-tests/test_reasoning.py); here: accepted, output unchanged
    # on a server without one, and dropping reasoning kept inline is a 400.
    def check(w: Walk):
        if w.route == "/v1/completions":
            return
        assert w.text(w(**{field: value})) == w.text(w())
        r = w.raw(separate_reasoning=False, include_reasoning=False)
        assert r.status_code == 400 and r.json()["error"]["param"] == "include_reasoning", r.text

    return check


def _continue_final_message(w: Walk):
    turn = MESSAGES + [{"role": "assistant", "content": "Once upon"}]
    closed = w(messages=turn, add_generation_prompt=False)["usage"]["prompt_tokens"]
    opened = w(messages=turn, continue_final_message=True, add_generation_prompt=False)["usage"]["prompt_tokens"]
    assert opened < closed, (opened, closed)
    r = w.raw(messages=turn, continue_final_message=True, add_generation_prompt=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_generation_prompt", r.text


def _echo(w: Walk):
    if w.route == "/v1/completions":
        assert Walk.text(w(echo=True)).startswith("Once upon a time")
    else:
        _default_only("echo", False, True)(w)


def _max_completion_tokens(w: Walk):
    # The newer name of max_tokens (the walk's base sends max_tokens=8): one of them, or both equal.
    assert w(max_completion_tokens=3, max_tokens=None, ignore_eos=True)["usage"]["completion_tokens"] == 3
    assert w(max_completion_tokens=3, max_tokens=3, ignore_eos=True)["usage"]["completion_tokens"] == 3
    r = w.raw(max_completion_tokens=3, ignore_eos=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def _best_of(w: Walk):
    assert len(w(n=2, best_of=2, temperature=1.0)["choices"]) == 2
    _refused(w, "best_of", best_of=3, temperature=1.0)


HONOURED = {
    # shared by both routes
    "model": _labels_only("model", "anything"),
    "user": _labels_only("user", "user-1234"),
    "priority": _priority,
    "max_tokens": lambda w: w(max_tokens=3, ignore_eos=True)["usage"]["completion_tokens"] == 3 or pytest.fail(),
    "temperature": lambda w: (w.text(w(temperature=1.5, seed=3, ignore_eos=True)) != w.text(w(ignore_eos=True)))
    or pytest.fail("temperature had no effect"),
    "top_p": _sampled_equals_greedy(top_p=1e-6),
    "top_k": _sampled_equals_greedy(top_k=1),
    "min_p": _sampled_equals_greedy(min_p=1.0),
    "n": lambda w: len(w(n=2, temperature=1.0)["choices"]) == 2 or pytest.fail(),
    "stream": _stream,
    "stream_options": _stream_options,
    "stop": _stop,
    "presence_penalty": _penalty("presence_penalty", 2.0),
    "frequency_penalty": _penalty("frequency_penalty", 2.0),
    "repetition_penalty": _penalty("repetition_penalty", 1.5),
    "seed": _seed,
    "response_format": lambda w: Walk.text(w(response_format={"type": "json_schema", "json_schema": {
        "name": "b", "schema": {"type": "boolean"}}})) in ("true", "false") or pytest.fail(),
    "ignore_eos": lambda w: w(logit_bias=FORCE_EOS, ignore_eos=True)["usage"]["completion_tokens"] == 8
    or pytest.fail(),
    "min_tokens": lambda w: w(logit_bias=FORCE_EOS, min_tokens=3)["usage"]["completion_tokens"] == 4
    or pytest.fail(),
    "stop_token_ids": lambda w: w(logit_bias={"504": 100}, stop_token_ids=[504])["usage"]["completion_tokens"] == 1
    or pytest.fail(),
    "logit_bias": lambda w: w(logit_bias=FORCE_EOS)["usage"]["completion_tokens"] == 1 or pytest.fail(),
    # what vLLM's and SGLang's servers add (their routers send them: docs/api.md)
    "no_stop_trim": _keep_stop("no_stop_trim"),
    "include_stop_str_in_output": _keep_stop("include_stop_str_in_output"),
    "skip_special_tokens": _skip_special_tokens,
    "spaces_between_special_tokens": _spaces_between_special_tokens,
    "return_hidden_states": _default_only("return_hidden_states", False, True),
    "lora_path": _default_only("lora_path", None, "my-adapter"),
    "session_params": _default_only("session_params", None, {"id": "s1"}),
    "ebnf": _default_only("ebnf", None, 'root ::= "a"'),
    "regex": lambda w: Walk.text(w(regex="(yes|no)")) in ("yes", "no") or pytest.fail(),
    "structured_outputs": lambda w: Walk.text(w(structured_outputs={"choice": ["alpha", "beta"]}))
    in ("alpha", "beta") or pytest.fail(),
    "sampling_seed": _sampling_seed,
    "safety_identifier": _labels_only("safety_identifier", "end-user-1"),
    "prompt_cache_key": _labels_only("prompt_cache_key", "conversation-1"),
    # /v1/completions
    "prompt": _prompt_tokens_grow(prompt="Once upon a time, far away and long ago,"),
    "logprobs": lambda w: (0 < len(w(logprobs=2)["choices"][0]["logprobs"]["top_logprobs"][0]) <= 2
                           if w.route == "/v1/completions" else bool(w(logprobs=True)["choices"][0]["logprobs"]["content"]))
    or pytest.fail(),
    "echo": _echo,
    "suffix": _default_only("suffix", "", "the end."),
    "best_of": _best_of,
    "json_schema": lambda w: Walk.text(w(json_schema='{"type": "boolean"}')) in ("true", "false") or pytest.fail(),
    "prompt_logprobs": lambda w: len(w(prompt_logprobs=0)["choices"][0]["prompt_logprobs"])
    == w()["usage"]["prompt_tokens"] or pytest.fail(),
    # /v1/chat/completions
    "messages": _prompt_tokens_grow(messages=[{"role": "user", "content": "Say something longer than before."}]),
    "max_completion_tokens": _max_completion_tokens,
    "top_logprobs": lambda w: len(w(logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"][0][
        "top_logprobs"]) == 2 or pytest.fail(),
    "tools": _prompt_tokens_grow(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "chat_template_kwargs": _prompt_tokens_grow(chat_template_kwargs={"greeting": "Hello there, friend."}),
    "tool_choice": lambda w: w(tools=NO_ARGS_TOOL, tool_choice="required", max_tokens=40)["choices"][0][
        "message"]["tool_calls"][0]["function"]["name"] == "f" or pytest.fail(),
    "parallel_tool_calls": _parallel_tool_calls,
    "add_generation_prompt": lambda w: w(add_generation_prompt=False)["usage"]["prompt_tokens"]
    < w()["usage"]["prompt_tokens"] or pytest.fail(),
    "continue_final_message": _continue_final_message,
    "reasoning_effort": _prompt_tokens_grow(reasoning_effort="high"),
    "separate_reasoning": _reasoning_field("separate_reasoning", False),
    "include_reasoning": _reasoning_field("include_reasoning", False),
    "stream_reasoning": _reasoning_field("stream_reasoning", False),
    "functions": _default_only("functions", None, [{"name": "f", "parameters": {}}]),
    "function_call": _default_only("function_call", None, "auto"),
    "service_tier": _default_only("service_tier", "auto", "flex"),
    "verbosity": _default_only("verbosity", "medium", "low"),
    "metadata": _default_only("metadata", None, {"k": "v"}),
    "modalities": _default_only("modalities", ["text"], ["text", "audio"]),
}


@pytest.mark.parametrize("route,schema", [("/v1/completions", "CompletionRequest"),
                                          ("/v1/chat/completions", "ChatCompletionRequest")])
def test_every_request_field_is_honoured_or_rejected(srv, route, schema):
    spec = httpx.get(f"{srv.url}/openapi.json", timeout=10).json()
    fields = resolve(spec, spec["components"]["schemas"][schema])
    assert {"max_tokens", "logit_bias", "ignore_eos"} <= fields, fields
    unchecked = fields - set(HONOURED)
    assert not unchecked, f"fields without a behavioural check: {sorted(unchecked)}"
    w = Walk(srv, route)
    for field in sorted(fields):
        HONOURED[field](w)
    # Anything else is rejected, named.
    r = w.raw(definitely_not_a_field=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "definitely_not_a_field"
