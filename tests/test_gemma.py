"""Gemma 2 and Gemma 3 text models (models/gemma.py) against transformers, float32.

Tiny configs that switch on everything Gemma adds: interleaved local
(5-token window) and global layers, query_pre_attn_scalar != head_dim,
Gemma 2's attention and final logit soft-capping (caps small enough to
bite with these weights), Gemma 3's q/k norms and its local rope base
next to a linearly scaled global rope. The batch is test_model's: 4 prompts
of 7, 13, 1 and 10 tokens, one joining mid-way, 20 decode steps, so every
sequence but one runs past the window. The reference is transformers'
eager attention (conftest.load_hf), which applies both the window and the
soft cap (its sdpa path refuses soft-capping).
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_model_dir, load_hf
from test_model import PagedHarness, check_prefill_and_decode, prompts

from pagemill.models.config import ModelConfig
from pagemill.models.loader import load_model

LAYERS = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              query_pre_attn_scalar=24, sliding_window=5)  # fmt: skip
VARIANTS = {
    # layers: sliding, global, sliding (Gemma 2's default interleaving)
    "gemma2": ("Gemma2Config", dict(**LAYERS, attn_logit_softcapping=4.0, final_logit_softcapping=3.0), {}),
    # layers: sliding, sliding, global
    "gemma3": (
        "Gemma3TextConfig",
        dict(**LAYERS, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}),
        {},
    ),  # fmt: skip
}
WINDOWS = {"gemma2": (5, None, 5), "gemma3": (5, 5, None)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def gemma_model(request, tmp_path_factory):
    path = build_model_dir(str(tmp_path_factory.mktemp(request.param)), request.param, variants=VARIANTS)
    return request.param, path, load_hf(path)


def test_prefill_and_decode_match_transformers(gemma_model):
    name, path, hf = gemma_model
    model, config = load_model(path, "float32", "cpu")
    assert config.layer_windows == WINDOWS[name]
    assert model.model.fused is None  # Gemma's layer is not the fused kernel's
    check_prefill_and_decode(name, path, hf, cpu_kernels=True)


def test_soft_caps_and_window_matter(gemma_model):
    """Each Gemma feature changes the logits: the test above would catch it missing."""
    name, path, hf = gemma_model
    model, config = load_model(path, "float32", "cpu", cpu_kernels=False)
    (tokens,) = prompts(config.vocab_size, [12], seed=3)

    def logits() -> torch.Tensor:
        return PagedHarness(model, config).prefill({0: tokens})[0]

    base = logits()
    layers = [layer.self_attn for layer in model.model.layers]
    for attn in layers:
        attn.sliding_window = None
    assert (logits() - base).abs().max() > 1e-3, "window"
    for attn, w in zip(layers, WINDOWS[name]):
        attn.sliding_window = w
    if name == "gemma2":
        for attn in layers:
            attn.softcap = None
        assert (logits() - base).abs().max() > 1e-3, "attention soft cap"


def test_bfloat16_tracks_float32_reference(gemma_model):
    name, path, hf = gemma_model
    model, config = load_model(path, "bfloat16", "cpu")
    h = PagedHarness(model, config, dtype=torch.bfloat16)
    (tokens,) = prompts(config.vocab_size, [12], seed=9)
    ours = torch.cat([h.prefill({0: tokens})[0], h.decode({0: tokens + [5]})[0][None]])
    ref = hf(torch.tensor([tokens + [5]])).logits[0].float().detach()
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 5e-2, f"{name} bf16: relative max error {rel:.2e}"


def _tp_steps(group, dirs: dict) -> dict:
    from test_parallel import _steps

    return {v: _steps(d, group) for v, d in dirs.items()}


def test_two_ranks_match_one_rank(tmp_path_factory):
    """Tensor parallelism (2 gloo ranks): heads and GeGLU features split, norms replicated."""
    from test_parallel import _steps, run_ranks

    dirs = {v: build_model_dir(str(tmp_path_factory.mktemp(v)), v, variants=VARIANTS) for v in VARIANTS}
    ranks = run_ranks(_tp_steps, dirs)
    for variant, model_dir in dirs.items():
        for step, (a, b, ref) in enumerate(zip(ranks[0][variant], ranks[1][variant], _steps(model_dir, None))):
            assert torch.equal(a, b), f"{variant} step {step}: ranks disagree"
            rel = ((a - ref).abs().max() / ref.abs().max()).item()
            assert rel < 1e-5, f"{variant} step {step}: 2 ranks vs 1 relative error {rel:.2e}"


BASE = dict(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=4,
            head_dim=16)  # fmt: skip


def test_gemma3_config_as_shipped():
    """transformers 4.x's Gemma 3 layout: rope_theta (global) + rope_local_base_freq, rope_scaling for
    global layers only, sliding_window_pattern instead of layer_types, no tie_word_embeddings key."""
    d = {**BASE, "model_type": "gemma3_text", "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
         "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
         "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
    c = ModelConfig.from_dict(d)
    assert c.rope_theta == 1000000.0 and c.rope_scaling.rope_type == "linear" and c.rope_scaling.factor == 8.0
    assert c.gemma.local_rope_theta == 10000.0 and c.gemma.local_rope_scaling is None
    assert c.layer_windows == ((512,) * 5 + (None,)) * 2
    assert c.tie_word_embeddings and c.qk_norm and c.gemma.query_pre_attn_scalar == 256
    assert c.gemma.attn_logit_softcapping is None and c.gemma.final_logit_softcapping is None


def test_gemma2_config_as_shipped():
    d = {**BASE, "model_type": "gemma2", "rope_theta": 10000.0, "sliding_window": 4096,
         "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 224,
         "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
    c = ModelConfig.from_dict(d)
    assert c.layer_windows == (4096, None) * 6 and not c.qk_norm
    assert c.gemma.attn_logit_softcapping == 50.0 and c.gemma.final_logit_softcapping == 30.0
    assert c.gemma.local_rope_theta == c.rope_theta == 10000.0
    with pytest.raises(ValueError, match="unsupported hidden_activation 'relu'"):
        ModelConfig.from_dict({**d, "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_dict({**d, "model_type": "gemma3_text", "use_bidirectional_attention": True})
