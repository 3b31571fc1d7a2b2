"""`--model-impl transformers` (models/transformers_backend.py) and the choice of implementation
(models/impl.py).

OLMo2 (q/k RMSNorm over the whole projection, post-norms) and Granite
(embedding, attention, residual and logits multipliers) have no native code:
transformers' modeling code runs them with our paged attention. The same
check as the native models: 4 prompts in the paged pool with a late joiner,
logits within 1e-4 relative of transformers' own eager forward at the prefill
and at 20 decode steps. A native Llama forced through transformers gives the
same logits too.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import build_model_dir, load_hf
from test_model import check_prefill_and_decode

from pagemill.models.impl import choose_impl
from pagemill.models.loader import load_model
from pagemill.models.transformers_backend import TransformersCausalLM

LAYERS = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
VARIANTS = {
    "olmo2": ("Olmo2Config", dict(**LAYERS), {}),
    "granite": ("GraniteConfig", dict(**LAYERS, logits_scaling=4.0, attention_multiplier=0.2,
                                      residual_multiplier=0.5, embedding_multiplier=3.0), {}),  # fmt: skip
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def no_native_model(request, tmp_path_factory):
    path = build_model_dir(str(tmp_path_factory.mktemp(request.param)), request.param, variants=VARIANTS)
    return request.param, path, load_hf(path)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_prefill_and_decode_match_transformers(no_native_model, cpu_kernels):
    name, path, hf = no_native_model
    assert choose_impl(path, "auto").impl == "transformers"  # auto: no native code for these
    check_prefill_and_decode(name, path, hf, cpu_kernels)


def test_cached_prefix_gives_same_logits(no_native_model):
    """Prefix caching: a step that starts past a shared cached prefix (aligned and unaligned)."""
    from test_model import test_cached_prefix_gives_same_logits as check

    check(no_native_model)


def test_shard_reports_the_implementation(no_native_model):
    from pagemill.shard.model_runner import ModelRunner

    _, path, _ = no_native_model
    model, config = load_model(path, "float32", "cpu")
    runner = ModelRunner(model, config, kv_cache_memory=1 << 20)
    assert runner.info().model_impl == "transformers" and not runner.use_cuda_graphs


def test_attention_goes_through_the_paged_pool(no_native_model):
    """The model really runs our attention: a forward without a paged step is refused."""
    _, path, _ = no_native_model
    model, config = load_model(path, "float32", "cpu")
    assert isinstance(model, TransformersCausalLM) and model.hf.config._attn_implementation == "pagemill"
    with pytest.raises(RuntimeError, match="outside a pagemill forward"):
        model.hf(torch.tensor([[5, 6, 7]]))


def test_native_llama_forced_through_transformers(llama_dir):
    from conftest import load_hf as hf_of

    model, _ = load_model(llama_dir, "float32", "cpu", model_impl="transformers")
    assert isinstance(model, TransformersCausalLM)
    assert choose_impl(llama_dir, "auto").impl == "native"
    import test_model

    original = test_model.load_model
    test_model.load_model = lambda *a, **k: load_model(*a, **k, model_impl="transformers")
    try:
        check_prefill_and_decode("llama via transformers", llama_dir, hf_of(llama_dir))
    finally:
        test_model.load_model = original


def _config_only(tmp_path, **config) -> str:
    """A model dir with a config.json and no weights at all: the choice never reads weights."""
    path = tmp_path / config["model_type"]
    path.mkdir()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def test_errors_name_the_architecture_before_any_weight(tmp_path):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    t5 = _config_only(tmp_path, model_type="t5", architectures=["T5ForConditionalGeneration"], **base)
    with pytest.raises(ValueError, match=r"cannot serve T5ForConditionalGeneration: no native implementation "
                                         r"\(unsupported model_type 't5'.*has no causal LM for model_type 't5'"):
        choose_impl(t5, "auto")
    olmo2 = _config_only(tmp_path, model_type="olmo2", architectures=["Olmo2ForCausalLM"], **base)
    with pytest.raises(ValueError, match="Olmo2ForCausalLM has no native pagemill implementation"):
        choose_impl(olmo2, "native")
    with pytest.raises(ValueError, match="Olmo2ForCausalLM runs through transformers.*use one shard"):
        choose_impl(olmo2, "auto", world_size=2)
    with pytest.raises(ValueError, match="--quantize int8 needs a native model"):
        choose_impl(olmo2, "auto", quantize="int8")
    # A config transformers has, but whose attention bypasses the attention interface.
    stablelm = _config_only(tmp_path, model_type="stablelm", architectures=["StableLmForCausalLM"], **base)
    with pytest.raises(ValueError, match="StableLmForCausalLM's attention does not go through"):
        choose_impl(stablelm, "transformers")
    # Windows and soft-capping, which the paged attention function does not apply: refused at launch,
    # naming the config field (not at warmup, when the first forward reaches the attention function).
    mistral = _config_only(tmp_path, model_type="mistral", architectures=["MistralForCausalLM"], **base,
                           sliding_window=16)
    with pytest.raises(ValueError, match=r"MistralForCausalLM cannot run through transformers.*`sliding_window` is 16"
                                         r".*its native implementation does"):
        choose_impl(mistral, "transformers")
    assert choose_impl(mistral, "auto").impl == "native"
    gemma2 = _config_only(tmp_path, model_type="gemma2", architectures=["Gemma2ForCausalLM"], **base,
                          sliding_window=None, head_dim=8)
    with pytest.raises(ValueError, match=r"`attn_logit_softcapping` is 50.0"):  # transformers' default
        choose_impl(gemma2, "transformers")
    cohere2 = _config_only(tmp_path, model_type="cohere2", architectures=["Cohere2ForCausalLM"], **base,
                           sliding_window=8, layer_types=["sliding_attention"])
    with pytest.raises(ValueError, match=r"Cohere2ForCausalLM cannot run through transformers.*`layer_types` has "
                                         r"sliding_attention layers \(sliding_window=8"):
        choose_impl(cohere2, "auto")
    qwen2 = _config_only(tmp_path, model_type="qwen2", architectures=["Qwen2ForCausalLM"], **base,
                         sliding_window=16, use_sliding_window=False)
    assert choose_impl(qwen2, "transformers").impl == "transformers"  # a window the config switches off
    with pytest.raises(ValueError, match="unknown model implementation 'vllm'"):
        choose_impl(olmo2, "vllm")
    # The loader asks first: no safetensors are ever opened.
    with pytest.raises(ValueError, match="cannot serve T5ForConditionalGeneration"):
        load_model(t5, "float32", "cpu")
