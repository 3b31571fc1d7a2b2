"""Every native architecture from a GGUF file, kept quantized, against transformers (float32).

Each variant is a tiny random HF model written to GGUF by tests/gguf_writer.py with llama.cpp's
conventions for its architecture and weights quantized to the variant's types. Checked:
- the config we read from the file is the original model's (models/config.ModelConfig), and
  agrees with transformers' own GGUF config on every key transformers reads;
- test_model's paged check (4 prompts, one joining late, 20 greedy decode steps): our logits,
  torch reference path, within 1e-4 relative of the reference's at every prefill and decode step.
The reference is transformers' GGUF loader on the same file (it dequantizes with gguf-py), given
the original config where its GGUF config reader leaves fields to class defaults that llama.cpp
fixes otherwise (Gemma's scale and windows, Qwen-MoE's expert sizes). Mixtral, which llama.cpp
writes as a llama file with experts and transformers does not read, is compared with our HF
directory conversion of the same file (dequantized weights) loaded by transformers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import build_model_dir
from gguf import GGMLQuantizationType as T
from gguf_vocab import byte_level_vocab, sentencepiece_vocab
from gguf_writer import default_types, write_gguf
from test_model import check_prefill_and_decode

from pagemill.models.config import ModelConfig
from pagemill.models.gguf.archs import hf_config
from pagemill.models.gguf.convert import convert_gguf_to_hf
from pagemill.models.gguf.reader import GGUFModel

L = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
GEMMA = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
             sliding_window=5)  # fmt: skip
K = dict(hidden_size=256, intermediate_size=512)  # rows of whole 256-value k-quant blocks


def q4_k_m(name: str, shape: tuple[int, ...]) -> T:
    """Q4_K_M's mix: Q6_K for attn_v and ffn_down, Q8_0 embedding, Q4_K elsewhere, F32 vectors."""
    if len(shape) < 2:
        return T.F32
    if name == "token_embd.weight":
        return T.Q8_0
    return T.Q6_K if any(p in name for p in ("attn_v", "ffn_down")) else T.Q4_K


def mixed_k(name: str, shape: tuple[int, ...]) -> T:
    return T.F32 if len(shape) < 2 else T.Q5_K if "attn" in name else T.Q6_K if "ffn" in name else T.F16


# name -> (transformers config class, kwargs, ggml types, vocab flavour)
VARIANTS = {
    "llama": ("LlamaConfig", dict(**L), T.Q8_0, "gpt2"),
    "llama_q4_k_m": ("LlamaConfig", dict(**L, **K, tie_word_embeddings=True), q4_k_m, "gpt2"),
    "mistral": ("MistralConfig", dict(**L, head_dim=32, sliding_window=None), T.Q4_0, "llama"),
    "qwen2": ("Qwen2Config", dict(**L, rope_theta=1000000.0), T.Q4_1, "gpt2"),
    "qwen3": ("Qwen3Config", dict(**L, head_dim=32, attention_bias=True, tie_word_embeddings=True), T.Q5_0, "gpt2"),
    "phi3": ("Phi3Config", dict(**L, sliding_window=None, pad_token_id=0), T.F16, "phi3"),
    "gemma2": ("Gemma2Config", dict(**GEMMA, attn_logit_softcapping=4.0, final_logit_softcapping=3.0), T.Q5_1, "gemma"),
    "gemma3": ("Gemma3TextConfig", dict(**GEMMA, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1000000.0}}),
               T.BF16, "gemma"),
    "gemma3_k": ("Gemma3TextConfig", dict(**{**GEMMA, "head_dim": 64, "query_pre_attn_scalar": 64}, **K), mixed_k,
                 "gemma"),
    "mixtral": ("MixtralConfig", dict(**L, num_local_experts=4, num_experts_per_tok=2, sliding_window=None), T.Q8_0,
                "gpt2"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(**L, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=96, norm_topk_prob=False), T.Q8_0, "gpt2"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(**L, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True, head_dim=32), T.Q4_0, "gpt2"),
}  # fmt: skip
HF_DIR_REFERENCE = ("mixtral",)  # transformers has no GGUF reader for llama files with experts
# Keys transformers reads from a GGUF's metadata for every architecture (integrations/ggml.py).
TRANSFORMERS_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                     "bos_token_id", "eos_token_id")  # fmt: skip


def vocab_for(flavour: str, size: int = 320):
    return byte_level_vocab(size) if flavour == "gpt2" else sentencepiece_vocab(size, flavour)


def write_variant(tmp: Path, name: str, variants: dict = VARIANTS) -> tuple[str, Path]:
    cls, kwargs, types, flavour = variants[name]
    model_dir = build_model_dir(str(tmp / "hf"), name, variants={name: (cls, kwargs, {})})
    qtype = types if callable(types) else default_types(types)
    (path,) = write_gguf(model_dir, tmp / f"{name}.gguf", vocab_for(flavour), qtype)
    return model_dir, path


def reference(name: str, model_dir: str, path: Path, tmp: Path):
    """transformers on the same weights: its GGUF loader, or (HF_DIR_REFERENCE) our conversion."""
    eager = dict(dtype=torch.float32, attn_implementation="eager")
    if name in HF_DIR_REFERENCE:
        converted = convert_gguf_to_hf(path, tmp / "converted")
        return transformers.AutoModelForCausalLM.from_pretrained(converted, **eager).eval()
    own = ModelConfig.from_dict(json.loads((Path(model_dir) / "config.json").read_text())).model_type
    # transformers maps the file's architecture to a gguf-py one through config.model_type; Mistral is a llama file.
    config = None if own == "mistral" else transformers.AutoConfig.from_pretrained(model_dir)
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                             **eager).eval()  # fmt: skip


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    model_dir, path = write_variant(tmp, request.param)
    return request.param, model_dir, path, tmp


def test_config_is_the_original(variant):
    name, model_dir, path, _ = variant
    original = ModelConfig.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))
    ours = ModelConfig.from_dict(hf_config(GGUFModel(path)))
    vocab = vocab_for(VARIANTS[name][3])
    # The token ids are the tokenizer's (the tiny HF config's are placeholders); Mistral is a llama
    # file, served as llama (the same computation).
    assert (ours.bos_token_id, ours.eos_token_ids) == (vocab.ids["bos"], (vocab.ids["eos"],))
    expect = dataclasses.replace(original, bos_token_id=ours.bos_token_id, eos_token_ids=ours.eos_token_ids,
                                 model_type="llama" if original.model_type == "mistral" else original.model_type)
    assert ours == expect


def _rope_theta(d: dict) -> float | None:
    return d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta")


@pytest.mark.parametrize("name", [n for n in VARIANTS if n not in HF_DIR_REFERENCE])
def test_config_agrees_with_transformers_gguf_config(name, tmp_path):
    _, path = write_variant(tmp_path, name)
    theirs = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    ours = hf_config(GGUFModel(path))
    for key in TRANSFORMERS_KEYS:
        assert ours[key] == theirs[key], key
    if _rope_theta(theirs) is not None:
        assert ours["rope_theta"] == pytest.approx(_rope_theta(theirs), rel=1e-6)


def test_logits_match_reference(variant):
    name, model_dir, path, tmp = variant
    check_prefill_and_decode(f"{name} (GGUF)", str(path), reference(name, model_dir, path, tmp), cpu_kernels=False)


def test_compiled_kernels_per_architecture(variant):
    """Where the quant kernels are built, every linear of every architecture (Phi-3's fused ones,
    Gemma's, Qwen3's, each MoE expert and router) runs on them, and the logits of a prefill and
    a decode step stay close to the torch reference path's. The kernels round activations to
    int8 blocks as ggml does (each linear within ~0.5% of the float result: test_gguf_dequant.py);
    these tiny random models (hidden 64, no trained smoothness) amplify that through their
    layers, up to ~5% of the mean |logit| on average and single logits further (Gemma 2's
    sandwich norms: 18% of the largest), so the check is on the whole logit vector: cosine
    similarity above 0.995 and mean error under 8% of the mean |logit|. The real files'
    quality on the kernels is measured in docs/quantization.md."""
    from test_gguf_dequant import compiled_kernel
    from test_model import PagedHarness, prompts

    from pagemill.models.gguf.linear import GGUFLinear
    from pagemill.models.loader import load_model

    kernel = compiled_kernel()
    name, _, path, _ = variant
    ours, config = load_model(str(path), "float32", "cpu", cpu_kernels=True)
    ref, _ = load_model(str(path), "float32", "cpu", cpu_kernels=False)
    linears = [m for m in ours.modules() if isinstance(m, GGUFLinear)]
    assert linears and all(m.on_kernel and kernel.supports(m.qtype) for m in linears), name
    tokens = prompts(config.vocab_size, [11])[0]
    h, r = PagedHarness(ours, config), PagedHarness(ref, config)
    pairs = [(h.prefill({0: tokens})[0], r.prefill({0: tokens})[0])]
    pairs.append((h.decode({0: tokens + [7]})[0], r.decode({0: tokens + [7]})[0]))
    for a, b in pairs:
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
        mean = ((a - b).abs().mean() / b.abs().mean()).item()
        assert cos > 0.995 and mean < 0.08, (name, cos, mean)
