"""OpenAI routes with raw HTTP and with the unmodified `openai` client."""

import json

import httpx
import openai
import pytest

from server import error_code, sse_events

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    # max_retries=0: a 429 must surface, not be retried away.
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def generate_ids(server, prompt, max_new_tokens, add_special=True):
    r = httpx.post(f"{server.url}/generate", timeout=120, json={
        "inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_uses_the_models_template_like_transformers(server, hf_model, client):
    tok, _ = hf_model
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ref = generate_ids(server, rendered, 16)
    out = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=16)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref["generated_text"]
    assert out.usage.prompt_tokens == len(tok(rendered).input_ids)
    assert out.usage.completion_tokens == ref["details"]["generated_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.choices[0].finish_reason == {"length": "length"}.get(ref["details"]["finish_reason"], "stop")


def test_chat_stream_matches_non_stream(client):
    full = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]


def test_chat_stream_without_usage_ends_with_done(server):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[5:]) for line in lines[:-1]]
    assert all("usage" not in c for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_completions_and_stream(client, server):
    prompt = "The three primary colors are"
    ref = generate_ids(server, prompt, 12)
    out = client.completions.create(model="x", prompt=prompt, temperature=0, max_tokens=12)
    assert out.object == "text_completion"
    assert out.choices[0].text == ref["generated_text"]
    assert out.usage.completion_tokens == ref["details"]["generated_tokens"]
    chunks = list(client.completions.create(model="x", prompt=prompt, temperature=0, max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref["generated_text"]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completions_prompt_list_and_echo(client):
    out = client.completions.create(model="x", prompt=["Hello, my name is", "The sky is"], temperature=0,
                                    max_tokens=4, echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text.startswith("Hello, my name is")
    assert out.choices[1].text.startswith("The sky is")


def test_stop_string_and_list(client):
    base = client.completions.create(model="x", prompt="Count: 1, 2, 3, 4,", temperature=0, max_tokens=20)
    text = base.choices[0].text
    stop = text[2:4]
    for s in (stop, [stop, "zzzz"]):
        out = client.completions.create(model="x", prompt="Count: 1, 2, 3, 4,", temperature=0, max_tokens=20, stop=s)
        assert out.choices[0].text == text[:text.index(stop)]
        assert out.choices[0].finish_reason == "stop"


def test_max_completion_tokens_and_length_finish(client):
    out = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_completion_tokens=3)
    assert out.usage.completion_tokens == 3
    assert out.choices[0].finish_reason == "length"


def test_n_with_seed_is_reproducible_and_distinct(client):
    kw = dict(model="x", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12, n=3,
              seed=7, temperature=1.0, top_p=1.0)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    # choice 0 of n is the request with the same seed and n=1
    single = client.chat.completions.create(**dict(kw, n=1))
    assert single.choices[0].message.content == a.choices[0].message.content


def test_n_stream_tags_choices(client):
    chunks = list(client.completions.create(model="x", prompt="Once upon a time", max_tokens=6, n=2, seed=3,
                                            stream=True, stream_options={"include_usage": True}))
    indices = {c.choices[0].index for c in chunks if c.choices}
    assert indices == {0, 1}
    assert chunks[-1].usage.completion_tokens == 12


def test_n_greedy_is_rejected(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, n=2)
    assert "sampling" in e.value.response.json()["error"]["message"]


def test_chat_logprobs(client):
    out = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=5, logprobs=True,
                                         top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4
    assert "".join(e.token for e in content) == out.choices[0].message.content


def test_completion_logprobs(client):
    out = client.completions.create(model="x", prompt="The sky is", temperature=0, max_tokens=4, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text


def test_response_format_json_object_is_accepted(client):
    out = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=8,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "nope"},
])
def test_bad_response_format_is_400(server, fmt):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "response_format": fmt})
    assert r.status_code == 400, r.text
    assert error_code(r.json()) in ("validation", "invalid_json")


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.info()["model_id"]]


def test_top_p_one_and_temperature_sampling(client):
    out = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0.7, top_p=1.0, max_tokens=4,
                                         seed=1)
    assert out.usage.completion_tokens >= 1


def test_content_parts_are_flattened(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    a = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": parts, "temperature": 0, "max_tokens": 6}).json()
    b = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": MESSAGES, "temperature": 0, "max_tokens": 6}).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": "hello"},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": MESSAGES, "top_logprobs": 2},
    {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50},
    {"messages": MESSAGES, "temperature": 2.5},
    {"messages": MESSAGES, "max_tokens": 0},
    {"messages": MESSAGES, "max_tokens": 5000},
    {"messages": MESSAGES, "n": 0},
    {"messages": MESSAGES, "n": 50},
    {"messages": MESSAGES, "top_p": 0},
    {"messages": MESSAGES, "stop": 5},
])
def test_bad_chat_requests_are_400(server, body):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json=body)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_openai_client_gets_typed_errors(client, server):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="x", prompt="hi", max_tokens=100000)
    nowhere = openai.OpenAI(base_url=f"{server.url}/nope", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        nowhere.completions.create(model="x", prompt="hi")


@pytest.mark.parametrize("route", ["/", "/tokenize", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b"{not json", b"[]", b'{"prompt": 5, "messages": 5, "inputs": 5}'])
def test_malformed_json_on_every_post_route_is_4xx(server, route, raw):
    r = httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == (400 if route.startswith("/v1/") else 422), r.text
    assert error_code(r.json()) == "invalid_json"


def test_too_large_body_is_413(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x" * 3_000_000}, timeout=30)
    assert r.status_code == 413
    assert error_code(r.json()) == "payload_too_large"


def test_wrong_method_and_unknown_v1_route_are_404_json(server):
    for r in (httpx.get(f"{server.url}/v1/chat/completions"), httpx.post(f"{server.url}/v1/embeddings", json={})):
        assert r.status_code == 404 and error_code(r.json()) == "not_found"


def test_json_schema_response_format_constrains_output(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    out = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
        temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"city"} and isinstance(value["city"], str) and len(value["city"]) <= 12


def test_json_object_response_format_gives_json(client):
    out = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Give me a JSON object with your name."}], temperature=0,
        max_tokens=60, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        json.loads(out.choices[0].message.content)


def test_tgi_regex_grammar_constrains_output(server):
    r = httpx.post(f"{server.url}/generate", timeout=60, json={
        "inputs": "Is Paris in France? Answer yes or no:", "parameters": {
            "max_new_tokens": 5, "grammar": {"type": "regex", "value": "(yes|no)"}}})
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"].strip() in ("yes", "no")
