"""TGI routes on the default model against Hugging Face transformers."""

import httpx
import pytest
import torch

from server import sse_events

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "def fibonacci(n):",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generate_matches_transformers(server, hf_model, prompt):
    tok, model = hf_model
    max_new = 24
    r = httpx.post(f"{server.url}/generate", timeout=120, json={
        "inputs": prompt, "parameters": {"max_new_tokens": max_new, "details": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=tok.eos_token_id)
    ref_ids = out[0, ids.shape[1]:].tolist()
    ours = [t["id"] for t in body["details"]["tokens"]]
    assert ours == ref_ids
    assert body["generated_text"] == tok.decode(ref_ids, skip_special_tokens=True)
    assert body["details"]["generated_tokens"] == len(ref_ids)
    expected = "eos_token" if ref_ids[-1] in (model.generation_config.eos_token_id
                                               if isinstance(model.generation_config.eos_token_id, list)
                                               else [model.generation_config.eos_token_id]) else "length"
    assert body["details"]["finish_reason"] == expected


def test_stream_matches_generate(server):
    prompt = PROMPTS[1]
    params = {"max_new_tokens": 16, "details": True}
    full = httpx.post(f"{server.url}/generate", json={"inputs": prompt, "parameters": params}, timeout=60).json()
    with httpx.stream("POST", f"{server.url}/generate_stream", timeout=60,
                      json={"inputs": prompt, "parameters": params}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert [e["token"]["id"] for e in events] == [t["id"] for t in full["details"]["tokens"]]
    assert all(e["generated_text"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == full["generated_text"]
    assert events[-1]["details"]["generated_tokens"] == len(events)
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == full["generated_text"]


def test_stop_sequence_is_excluded(server):
    prompt = "Count: 1, 2, 3, 4,"
    base = httpx.post(f"{server.url}/generate", timeout=60, json={
        "inputs": prompt, "parameters": {"max_new_tokens": 20}}).json()["generated_text"]
    assert len(base) > 4
    stop = base[2:4]
    r = httpx.post(f"{server.url}/generate", timeout=60, json={
        "inputs": prompt, "parameters": {"max_new_tokens": 20, "stop": [stop], "details": True}}).json()
    assert r["details"]["finish_reason"] == "stop_sequence"
    assert r["generated_text"] == base[:base.index(stop)]


def test_return_full_text(server):
    prompt = PROMPTS[1]
    r = httpx.post(f"{server.url}/generate", timeout=60, json={
        "inputs": prompt, "parameters": {"max_new_tokens": 4, "return_full_text": True}}).json()
    assert r["generated_text"].startswith(prompt)


def test_seeded_sampling_is_reproducible(server):
    params = {"max_new_tokens": 12, "do_sample": True, "temperature": 0.9, "top_p": 0.95, "seed": 1234,
              "details": True}
    a = httpx.post(f"{server.url}/generate", json={"inputs": PROMPTS[1], "parameters": params}, timeout=60).json()
    b = httpx.post(f"{server.url}/generate", json={"inputs": PROMPTS[1], "parameters": params}, timeout=60).json()
    assert a["generated_text"] == b["generated_text"]
    assert a["details"]["seed"] == 1234


def test_health_and_info(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    info = server.info()
    assert info["router"] == "pagemill"
    assert info["max_total_tokens"] == 2048
    assert info["kv_blocks_total"] > 0
    assert info["block_size"] == 64  # the CPU default (shard/kv_pool.py)
