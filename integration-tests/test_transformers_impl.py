"""Architectures without native code, served through transformers' modeling code
(`--model-impl auto` picks it) with pagemill's paged attention: greedy /generate of
concurrent requests (batched together) equals transformers' own generate, the startup
log and /info say which implementation runs, and every KV block is free afterwards."""

import concurrent.futures as cf
import json
import subprocess
import sys
import time

import httpx
import pytest

from server import launch
from tiny_models import hf_greedy, save_tiny_model

LAYERS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048)
ARCHS = {
    "olmo2": ("Olmo2Config", LAYERS),
    "granite": ("GraniteConfig", dict(**LAYERS, logits_scaling=4.0, attention_multiplier=0.2,
                                      residual_multiplier=0.5, embedding_multiplier=3.0)),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "Colorless green ideas sleep", "<|im_start|>user\nHi<|im_end|>\n"]
MAX_NEW = 12


@pytest.fixture(scope="module", params=list(ARCHS))
def served(request, tmp_path_factory, default_model_dir):
    cls, config = ARCHS[request.param]
    model_dir = save_tiny_model(tmp_path_factory.mktemp(request.param), default_model_dir, cls, **config)
    s = launch(str(model_dir), "--max-batch-prefill-tokens", "512", "--max-input-tokens", "256",
               "--max-total-tokens", "512", "--kv-cache-memory", "16MiB", "--block-size", "4")
    yield request.param, model_dir, s
    assert s.stop() == 0, s.logs()


def test_greedy_generate_matches_transformers(served):
    name, model_dir, server = served
    body = lambda p: {"inputs": p, "parameters": {"max_new_tokens": MAX_NEW, "details": True}}  # noqa: E731
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        rs = list(pool.map(lambda p: httpx.post(f"{server.url}/generate", json=body(p), timeout=300), PROMPTS))
    ours = []
    for r in rs:
        assert r.status_code == 200, r.text
        ours.append([t["id"] for t in r.json()["details"]["tokens"]])
    assert ours == hf_greedy(model_dir, PROMPTS, MAX_NEW), name
    assert any("transformers implementation" in line for line in server.logs().splitlines()), server.logs()
    assert server.info()["model_impl"] == "transformers"
    deadline = time.monotonic() + 10
    while (info := server.info())["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert info["kv_blocks_used"] == 0 and info["kv_blocks_free"] == info["kv_blocks_total"], info


def test_launch_refuses_an_unservable_model_before_starting_shards(tmp_path):
    """A config.json and no weights: `pagemill launch` names the architecture and exits."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": 64, "d_model": 32}))
    out = subprocess.run([sys.executable, "-m", "pagemill", "launch", "--model", str(tmp_path), "--port", "18399"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "pagemill cannot serve T5ForConditionalGeneration" in text, text
    assert "loading" not in text, text  # refused before any shard was started
