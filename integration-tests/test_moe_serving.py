"""A tiny Qwen2-MoE (routed experts, a shared expert, a dense layer among sparse ones) and a tiny
Mixtral (routed experts only, renormalised top-2) through `pagemill launch` with the native MoE code: 16 concurrent greedy requests of different lengths,
batched together, give transformers' own greedy tokens, and every KV block is free afterwards
(read from /metrics)."""

import concurrent.futures as cf
import time

import httpx
import pytest

from server import launch
from tiny_models import hf_greedy, save_tiny_model

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, num_experts=6, num_experts_per_tok=2,
              moe_intermediate_size=48, shared_expert_intermediate_size=80, mlp_only_layers=[1])
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls count silver stars".split()
PROMPTS = [" ".join(WORDS[: 1 + (3 * i) % len(WORDS)]) + f" {i}" for i in range(16)]
MAX_NEW = 16


MIXTRAL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=2048, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=None)
MODELS = {"Qwen2MoeForCausalLM": ("Qwen2MoeConfig", CONFIG), "MixtralForCausalLM": ("MixtralConfig", MIXTRAL)}


@pytest.fixture(scope="module", params=list(MODELS))
def moe(request, tmp_path_factory, default_model_dir):
    cls, config = MODELS[request.param]
    model_dir = save_tiny_model(tmp_path_factory.mktemp(request.param), default_model_dir, cls, **config)
    s = launch(str(model_dir), "--max-batch-prefill-tokens", "512", "--max-input-tokens", "256",
               "--max-total-tokens", "512", "--kv-cache-memory", "16MiB", "--block-size", "4")
    s.arch = request.param
    yield model_dir, s
    assert s.stop() == 0, s.logs()


def test_16_concurrent_greedy_requests_match_transformers(moe):
    model_dir, server = moe
    # Each architecture runs its own native code.
    assert any(f"{server.arch}: native implementation" in line for line in server.logs().splitlines())
    assert server.info()["model_impl"] == "native"
    body = lambda p: {"inputs": p, "parameters": {"max_new_tokens": MAX_NEW, "details": True}}  # noqa: E731
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        rs = list(pool.map(lambda p: httpx.post(f"{server.url}/generate", json=body(p), timeout=300), PROMPTS))
    ours = []
    for r in rs:
        assert r.status_code == 200, r.text
        ours.append([t["id"] for t in r.json()["details"]["tokens"]])
    ref = hf_greedy(model_dir, PROMPTS, MAX_NEW)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a == b, f"prompt {i} {PROMPTS[i]!r}"
    deadline = time.monotonic() + 10
    while server.metric("pagemill_kv_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("pagemill_kv_blocks_used") == 0
    assert server.metric("pagemill_kv_blocks_free") == server.metric("pagemill_kv_blocks_total") > 0
