"""--kv-cache-dtype int8 on the default model: the pool's size and greedy output against the bf16 cache."""

import httpx
import pytest

from server import launch

COMMON = ("--dtype", "bfloat16", "--block-size", "16", "--kv-cache-memory", "64MiB", "--max-input-tokens", "512",
          "--max-total-tokens", "640", "--max-batch-prefill-tokens", "1024")
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three primary colors:"]
NEW = 24
# SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, blocks of 16: int8 rows of 64 + 4 (scale) bytes.
INT8_BLOCK_BYTES = 2 * 30 * 3 * (64 + 4) * 16


# A first token whose lead over the runner-up is below this (nats) is a near tie: bf16 logits of
# this model step by 0.125 around their usual size, and int8 keys move them by a few steps. Measured
# on 2026-12-04: "Write a haiku about the sea." leads by 0.25 in bf16 and ties exactly over int8.
NEAR_TIE = 0.5


def greedy(server, prompt):
    """(the greedy tokens, the first position's top two as [(id, logprob)])."""
    r = httpx.post(f"{server.url}/generate", timeout=600, json={
        "inputs": prompt,
        "parameters": {"max_new_tokens": NEW, "details": True, "ignore_eos_token": True, "top_n_tokens": 2}})
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    top = sorted(((t["id"], t["logprob"]) for t in details["top_tokens"][0]), key=lambda t: -t[1])
    return [t["id"] for t in details["tokens"]], top


@pytest.mark.timeout(900)
def test_int8_kv_cache_serves_greedy_output(default_model_dir):
    blocks, outputs, firsts = {}, {}, {}
    for kv in ("auto", "int8"):
        s = launch(str(default_model_dir), *COMMON, "--kv-cache-dtype", kv)
        try:
            blocks[kv] = s.metric("pagemill_kv_blocks_total")
            outputs[kv], firsts[kv] = zip(*(greedy(s, p) for p in PROMPTS))
        finally:
            s.stop()
    # Block 0 is scratch and not counted; the budget's bytes include every row's scale.
    assert blocks["int8"] == (64 << 20) // INT8_BLOCK_BYTES - 1
    assert blocks["int8"] >= 1.85 * blocks["auto"]
    assert all(len(o) == NEW for o in outputs["int8"])
    # Greedy text tracks the bf16 cache: every first token (one prefill) where bf16's choice leads
    # clearly, one of bf16's top two where it is a near tie; then the tokens before each
    # continuation's first divergence (docs/kv_cache.md states the agreement measured on longer
    # prompts: int8 flips near-ties of this 135M model within tens of tokens).
    clear = 0
    for top, first in zip(firsts["auto"], (o[0] for o in outputs["int8"])):
        if top[0][1] - top[1][1] > NEAR_TIE:
            clear += 1
            assert first == top[0][0]
        else:
            assert first in (top[0][0], top[1][0])
    assert clear >= len(PROMPTS) - 1  # the check above is not all near ties
    agree = 0
    for a, b in zip(outputs["auto"], outputs["int8"]):
        k = 0
        while k < NEW and a[k] == b[k]:
            k += 1
        agree += k
    print(f"int8 blocks {blocks['int8']:.0f} vs {blocks['auto']:.0f}; greedy agreement {agree}/{NEW * len(PROMPTS)}")
    assert agree >= AGREEMENT_MIN * NEW * len(PROMPTS)


AGREEMENT_MIN = 0.5  # measured 74/96 (0.77) on 2026-12-04
