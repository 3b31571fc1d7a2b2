"""A multi-turn workload on a pool a quarter of its working set: earlier turns
are evicted to the second tier (host files) and later turns load them back;
greedy outputs equal those of a server whose pool holds everything."""

import json

import httpx
import pytest

from server import launch
from test_kv_cache import system_prompt

USERS, TURNS, DOC_TOKENS, ANSWER = 4, 3, 300, 8
BLOCK = 16


def pool_args(model_dir, blocks: int) -> tuple:
    """--kv-cache-memory for exactly `blocks` float32 blocks of this model."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_block = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * BLOCK * 4
    return ("--kv-cache-memory", str(blocks * per_block))


def conversations(server, docs: list[str]) -> tuple[list[list[int]], int]:
    """Round-robin turns, one request at a time: each turn extends its user's conversation."""
    history = list(docs)
    answers = [[] for _ in docs]
    for t in range(TURNS):
        for u in range(len(docs)):
            history[u] += f"\nUser: question {t} about item {u * 7 + t}?\nAssistant:"
            r = httpx.post(f"{server.url}/generate", timeout=300, json={
                "inputs": history[u], "parameters": {"max_new_tokens": ANSWER, "details": True}})
            assert r.status_code == 200, r.text
            body = r.json()
            answers[u].append([tok["id"] for tok in body["details"]["tokens"]])
            history[u] += body["generated_text"]
    return answers, max(len(h) for h in history)


@pytest.mark.timeout(400)
def test_multi_turn_evicts_to_the_tier_and_hits_it(default_model_dir, tmp_path):
    base = system_prompt(default_model_dir, DOC_TOKENS)
    docs = [f"Conversation {u}. {base}" for u in range(USERS)]
    # Working set ~ USERS x 380 tokens; the small pool holds 26 blocks (416 tokens), about a quarter.
    common = ("--max-batch-prefill-tokens", "512", "--max-input-tokens", "400", "--max-total-tokens", "416",
              "--block-size", str(BLOCK))
    small = launch(str(default_model_dir), *common, *pool_args(default_model_dir, 27),
                   "--kv-offload-dir", str(tmp_path / "kv"))
    try:
        assert small.metric("pagemill_kv_blocks_total") == 26
        tiered, _ = conversations(small, docs)
        saved = small.metric("pagemill_kv_tier_saved_blocks_total")
        loaded = small.metric("pagemill_kv_tier_loaded_blocks_total")
        hits = small.metric("pagemill_kv_tier_hit_blocks_total")
        computed_small = small.metric("pagemill_prefill_tokens_total")
    finally:
        small.stop()
    big = launch(str(default_model_dir), *common, "--kv-cache-memory", "256MiB")
    try:
        unconstrained, _ = conversations(big, docs)
        computed_big = big.metric("pagemill_prefill_tokens_total")
    finally:
        big.stop()
    print(f"tier: saved {saved:.0f} blocks, loaded {loaded:.0f}; prompt tokens computed {computed_small:.0f} "
          f"(unconstrained pool: {computed_big:.0f})")
    assert saved > 0 and loaded > 0 and hits >= loaded
    # Later turns found their earlier turns in the tier: most of the prompt work the big pool
    # saved through its prefix cache, the tier saved too.
    assert loaded * BLOCK >= (TURNS - 1) * USERS * DOC_TOKENS * 0.8
    assert tiered == unconstrained, "loading from the tier changed greedy outputs"
