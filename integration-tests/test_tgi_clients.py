"""TGI compatibility: the unmodified `text-generation` and `huggingface_hub`
clients, plus the TGI features they rely on (POST /, details, best_of,
decoder_input_details, top_n_tokens, headers, /tokenize)."""

import httpx
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client as TGIClient

PROMPT = "The three primary colors are"


def ref(server, **params):
    r = httpx.post(f"{server.url}/generate", timeout=120, json={
        "inputs": PROMPT, "parameters": dict({"max_new_tokens": 10, "details": True}, **params)})
    assert r.status_code == 200, r.text
    return r.json()


def test_text_generation_client_generate(server):
    expected = ref(server)
    out = TGIClient(server.url, timeout=120).generate(PROMPT, max_new_tokens=10, decoder_input_details=True,
                                                      top_n_tokens=2)
    assert out.generated_text == expected["generated_text"]
    assert [t.id for t in out.details.tokens] == [t["id"] for t in expected["details"]["tokens"]]
    assert out.details.finish_reason.value == expected["details"]["finish_reason"]
    assert len(out.details.prefill) > 1 and out.details.prefill[0].logprob is None
    assert all(p.logprob is not None for p in out.details.prefill[1:])
    assert len(out.details.top_tokens) == out.details.generated_tokens
    assert all(len(t) == 2 for t in out.details.top_tokens)


def test_text_generation_client_stream(server):
    expected = ref(server)
    events = list(TGIClient(server.url, timeout=120).generate_stream(PROMPT, max_new_tokens=10))
    assert [e.token.id for e in events] == [t["id"] for t in expected["details"]["tokens"]]
    assert events[-1].generated_text == expected["generated_text"]
    assert events[-1].details.generated_tokens == len(events)


def test_text_generation_client_best_of(server):
    out = TGIClient(server.url, timeout=120).generate(PROMPT, max_new_tokens=8, best_of=3, do_sample=True)
    others = out.details.best_of_sequences
    assert len(others) == 2
    best = sum(t.logprob for t in out.details.tokens)
    assert all(sum(t.logprob for t in o.tokens) <= best + 1e-4 for o in others)


def test_best_of_with_seed_is_reproducible(server):
    params = {"max_new_tokens": 8, "best_of": 2, "do_sample": True, "seed": 11, "details": True}
    a = httpx.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": params}, timeout=60).json()
    b = httpx.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": params}, timeout=60).json()
    assert a == b
    assert len(a["details"]["best_of_sequences"]) == 1


@pytest.mark.parametrize("params,needle", [
    ({"best_of": 2}, "sampling"),
    ({"best_of": 0}, "best_of"),
    ({"best_of": 99, "do_sample": True}, "best_of"),
])
def test_best_of_rules(server, params, needle):
    r = httpx.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": params}, timeout=30)
    assert r.status_code == 422 and needle in r.json()["error"]


def test_best_of_stream_is_rejected(server):
    r = httpx.post(f"{server.url}/generate_stream", timeout=30,
                   json={"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True}})
    assert r.status_code == 422


def test_hf_inference_client_text_generation(server):
    expected = ref(server)
    client = InferenceClient(base_url=server.url, timeout=120)
    out = client.text_generation(PROMPT, max_new_tokens=10, details=True)
    assert out.generated_text == expected["generated_text"]
    assert [t.id for t in out.details.tokens] == [t["id"] for t in expected["details"]["tokens"]]
    assert client.text_generation(PROMPT, max_new_tokens=10) == expected["generated_text"]
    events = list(client.text_generation(PROMPT, max_new_tokens=10, details=True, stream=True))
    assert [e.token.id for e in events] == [t["id"] for t in expected["details"]["tokens"]]
    assert events[-1].generated_text == expected["generated_text"]
    text = "".join(client.text_generation(PROMPT, max_new_tokens=10, stream=True))
    assert text == expected["generated_text"]


def test_hf_inference_client_chat_completion(server):
    client = InferenceClient(base_url=server.url, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat_completion(messages, max_tokens=12, temperature=0)
    assert out.choices[0].message.role == "assistant"
    content = out.choices[0].message.content
    assert content and out.usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat_completion(messages, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == content


def test_compat_route_dispatches_on_stream(server):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    r = httpx.post(server.url + "/", json=body, timeout=60)
    assert r.status_code == 200 and isinstance(r.json(), list) and "generated_text" in r.json()[0]
    with httpx.stream("POST", server.url + "/", json=dict(body, stream=True), timeout=60) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        assert sum(1 for line in s.iter_lines() if line.startswith("data:")) == 4


def test_timing_headers(server):
    r = httpx.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5}}, timeout=60)
    h = r.headers
    for name in ("x-compute-type", "x-compute-time", "x-total-time", "x-validation-time", "x-queue-time",
                 "x-inference-time", "x-time-per-token", "x-prompt-tokens", "x-generated-tokens"):
        assert name in h, name
    assert int(h["x-generated-tokens"]) == 5
    assert int(h["x-prompt-tokens"]) == len(httpx.post(f"{server.url}/tokenize", json={"inputs": PROMPT}).json())
    assert int(h["x-total-time"]) >= int(h["x-inference-time"])


def test_tokenize(server, hf_model):
    tok, _ = hf_model
    r = httpx.post(f"{server.url}/tokenize", json={"inputs": "Hello world, café"}, timeout=30)
    assert r.status_code == 200
    tokens = r.json()
    assert [t["id"] for t in tokens] == tok("Hello world, café").input_ids
    assert "".join(t["text"] for t in tokens) == "Hello world, café"
    assert all(set(t) == {"id", "text", "start", "stop"} for t in tokens)


def test_decoder_input_details_prefill(server, hf_model):
    tok, _ = hf_model
    out = ref(server, decoder_input_details=True, max_new_tokens=2)
    prefill = out["details"]["prefill"]
    assert [p["id"] for p in prefill] == tok(PROMPT).input_ids
    assert prefill[0]["logprob"] is None and all(p["logprob"] <= 0 for p in prefill[1:])


def test_truncate_and_return_full_text(server):
    out = ref(server, truncate=2, max_new_tokens=3, return_full_text=True, decoder_input_details=True)
    assert len(out["details"]["prefill"]) == 2
    assert out["generated_text"].startswith(PROMPT)


def test_grammar_parameter(server):
    ok = httpx.post(f"{server.url}/generate", timeout=60, json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 4, "grammar": {"type": "regex", "value": "[a-z ]+"}}})
    assert ok.status_code == 200, ok.text
    for grammar in ({"type": "regex", "value": "(unclosed"}, {"type": "json", "value": 5},
                    {"type": "json", "value": "not json"}, {"type": "xml", "value": "x"}):
        r = httpx.post(f"{server.url}/generate", timeout=30,
                       json={"inputs": PROMPT, "parameters": {"grammar": grammar}})
        assert r.status_code == 422, (grammar, r.text)


def test_info_has_tgi_fields(server):
    info = server.info()
    for key in ("model_id", "max_best_of", "max_input_tokens", "max_total_tokens", "max_concurrent_requests",
                "max_stop_sequences", "version", "model_pipeline_tag"):
        assert key in info, key
    assert info["has_chat_template"] is True and info["api_key_required"] is False


@pytest.mark.parametrize("fmt", [
    # huggingface_hub rewrites this into TGI's {"type": "json_object", "value": schema}
    lambda s: {"type": "json_schema", "json_schema": {"name": "answer", "schema": s}},
    lambda s: {"type": "json", "value": s},  # TGI's own chat form
])
def test_hf_chat_completion_response_format(server, fmt):
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    client = InferenceClient(base_url=server.url, timeout=120)
    out = client.chat_completion([{"role": "user", "content": "Capital of France, as JSON?"}], max_tokens=40,
                                 temperature=0, response_format=fmt(schema))
    assert set(json.loads(out.choices[0].message.content)) == {"city"}
