"""Prefix caching and preemption on the default model, against the same
requests on servers without the feature (or with an unconstrained pool)."""

import concurrent.futures as cf

import httpx
import pytest

from server import launch

SYSTEM = ("You are a meticulous assistant for a logistics company. Answer in one short sentence, "
          "cite the relevant policy number, never invent figures, and prefer metric units. ")


def system_prompt(model_dir, tokens: int = 512) -> str:
    """Exactly `tokens` tokens of shared system prompt."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "".join(f"Policy {i}: {SYSTEM}" for i in range(60))
    ids = tok.encode(text).ids[:tokens]
    return tok.decode(ids)


QUESTIONS = [f"Question {i}: how long may parcel {i * 37 % 101} wait at depot {i % 7}?" for i in range(64)]


def run_all(server, prompts, max_new_tokens=6, workers=16):
    def one(p):
        r = httpx.post(f"{server.url}/generate", timeout=600, json={
            "inputs": p, "parameters": {"max_new_tokens": max_new_tokens, "details": True}})
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    with cf.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, prompts))


COMMON = ("--max-batch-prefill-tokens", "2048", "--max-input-tokens", "1024", "--max-total-tokens", "1536",
          "--kv-cache-memory", "512MiB")


@pytest.mark.timeout(900)
def test_shared_system_prompt_computes_90pct_fewer_prefill_tokens(default_model_dir):
    sysp = system_prompt(default_model_dir)
    prompts = [f"{sysp}\n{q}" for q in QUESTIONS]
    results = {}
    for name, extra in (("cache", ()), ("no-cache", ("--no-prefix-caching",))):
        s = launch(str(default_model_dir), *COMMON, *extra)
        try:
            before = s.info()["prefill_tokens_total"]
            outputs = run_all(s, prompts)
            info = s.info()
            results[name] = (info["prefill_tokens_total"] - before, outputs, info)
        finally:
            s.stop()
    computed_cache, out_cache, info_cache = results["cache"]
    computed_plain, out_plain, _ = results["no-cache"]
    assert out_cache == out_plain, "prefix caching changed greedy outputs"
    saved = 1 - computed_cache / computed_plain
    print(f"prefill tokens: {computed_cache} with cache vs {computed_plain} without ({saved:.1%} fewer)")
    assert saved >= 0.90, (computed_cache, computed_plain)
    assert info_cache["prefix_hit_tokens_total"] > 0
    assert info_cache["kv_blocks_used"] == 0


@pytest.mark.timeout(900)
def test_quarter_sized_pool_preempts_and_matches_unconstrained(default_model_dir):
    # 64 requests x (~20 prompt + 96 new) tokens ~ 7400 tokens of working set;
    # 100 blocks of 16 = 1600 tokens is about a quarter of it (45 KiB per token).
    prompts = [f"Write a list of {i % 9 + 3} fruits, then explain why number {i} matters." for i in range(64)]
    outputs = {}
    pre = {}
    recomputed = {}
    for name, mem in (("big", "512MiB"), ("small", str(100 * 16 * 46080))):
        s = launch(str(default_model_dir), "--max-batch-prefill-tokens", "1024", "--max-input-tokens", "512",
                   "--max-total-tokens", "1024", "--kv-cache-memory", mem, "--max-concurrent-requests", "128")
        try:
            def one(p):
                r = httpx.post(f"{s.url}/generate", timeout=900, json={
                    "inputs": p, "parameters": {"max_new_tokens": 96, "ignore_eos_token": True, "details": True}})
                assert r.status_code == 200, r.text
                d = r.json()["details"]
                assert d["generated_tokens"] == 96
                return [t["id"] for t in d["tokens"]]

            with cf.ThreadPoolExecutor(64) as pool:
                outputs[name] = list(pool.map(one, prompts))
            info = s.info()
            pre[name] = info["preemptions_total"]
            recomputed[name] = info["recomputed_tokens_total"]
            assert info["kv_blocks_used"] == 0
            if name == "small":
                assert info["kv_blocks_total"] <= 110
        finally:
            s.stop()
    assert pre["small"] > 0, "the small pool never preempted"
    assert outputs["small"] == outputs["big"]
    print(f"small pool: {pre['small']} preemptions, {recomputed['small']} tokens recomputed")
    assert recomputed["small"] > 0
