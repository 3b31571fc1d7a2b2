"""Shared by test_sliding_window.py and test_gemma_server.py: a tiny random-weight model
of a given transformers config class with the default model's tokenizer, and 16
concurrent greedy requests checked token for token against transformers' generate."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

PROMPTS = [" ".join(["word"] * (3 + 2 * i)) + f" number {i}" for i in range(16)]  # 5..40 tokens
MAX_NEW = 30


def build(out: Path, default_model_dir: Path, config_cls: str, **kwargs) -> Path:
    import transformers

    config = getattr(transformers, config_cls)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, **kwargs,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than the default init, so attention is far from uniform
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.15)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, out / name)
    return out


def check_greedy_against_transformers(server, model_dir: Path) -> None:
    """16 concurrent requests; each one's tokens equal transformers' generate (eager attention)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def generate(prompt: str) -> dict:
        r = httpx.post(f"{server.url}/generate", timeout=300, json={
            "inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW, "details": True}})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(16) as pool:
        bodies = list(pool.map(generate, PROMPTS))
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for prompt, body in zip(PROMPTS, bodies):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                              pad_token_id=2)  # fmt: skip
        assert [t["id"] for t in body["details"]["tokens"]] == out[0, ids.shape[1] :].tolist(), prompt
