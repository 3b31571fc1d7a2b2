"""GGUF metadata -> the Hugging Face config.json of the same model, per architecture.

Keys are llama.cpp's (`<arch>.embedding_length`, ...). What llama.cpp does not store but
assumes is filled in with what llama.cpp's own loader assumes (llama-model.cpp), so that the
model computes what llama.cpp computes from the same file:
- gemma2/gemma3: the attention scale is head_dim ** -0.5 (query_pre_attn_scalar = head_dim),
  except the 27B models (46 / 62 layers): hidden_size / heads; Gemma 2's soft caps default to
  50 / 30 and its window to 4096, every other layer sliding; Gemma 3 slides in 5 of every 6
  layers, its local rotary base 10000 unless the file says (rope.freq_base_swa);
- qwen2moe: the top-k router weights are not renormalised, qwen3moe's are; every layer sparse;
- llama files hold Mistral too (same computation: llama.cpp keeps no sliding window for
  them) and Mixtral (expert_count > 0).
Rotary scaling: linear from rope.scaling.*; Llama 3's as the rope_freqs tensor of per-frequency
divisors, matched back to its llama3 parameters; Phi-3's LongRoPE as the rope_factors_long /
rope_factors_short tensors.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.rope import llama3_rope_scaling, longrope_scaling
from pagemill.models.gguf.types import GGUFError

# GGUF general.architecture values pagemill serves, with the HF model types each covers.
SUPPORTED_ARCHITECTURES = {
    "llama": "Llama, Mistral, Mixtral", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen2moe": "Qwen2-MoE",
    "qwen3moe": "Qwen3-MoE", "phi3": "Phi-3", "gemma2": "Gemma 2", "gemma3": "Gemma 3 (text)",
}  # fmt: skip
_REQUIRED = object()


def f32_clean(x: float) -> float:
    """GGUF stores floats as f32: 9.999999747e-06 reads back as the 1e-05 that was meant."""
    return float(str(np.float32(x)))


def unsupported_architecture(arch: str) -> GGUFError:
    listed = "; ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
    return GGUFError(f"unsupported GGUF architecture {arch!r}: pagemill serves {listed}")


class _Meta:
    def __init__(self, g: GGUFModel) -> None:
        self.g, self.arch = g, g.architecture

    def __call__(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.g.arch_value(key, None)
        if value is None:
            if default is _REQUIRED:
                raise GGUFError(f"{self.g.paths[0].name} lacks the metadata key {self.arch}.{key}")
            return default
        return value

    def uniform(self, key: str, default: Any = _REQUIRED) -> Any:
        """A per-model value that some files write per layer: the one value, or GGUFError."""
        value = self(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise GGUFError(f"{self.arch}.{key} differs between layers ({value}): not supported")
            value = value[0]
        return value


def hf_config(g: GGUFModel) -> dict[str, Any]:
    arch = g.architecture
    if arch not in _BUILDERS:
        raise unsupported_architecture(arch)
    a = _Meta(g)
    hidden, heads = int(a("embedding_length")), int(a.uniform("attention.head_count"))
    head_dim = int(a("attention.key_length", hidden // heads))
    if int(a("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{arch}: attention.value_length {a('attention.value_length')} != key_length {head_dim}")
    tokens = g.value("tokenizer.ggml.tokens") or []
    d: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(a.uniform("feed_forward_length", 0)),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a.uniform("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": f32_clean(a("attention.layer_norm_rms_epsilon")),
        "rope_theta": f32_clean(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(a("context_length", 2048)),
        "vocab_size": int(a("vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in g,
        "bos_token_id": g.value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": g.value("tokenizer.ggml.eos_token_id"),
        "pad_token_id": g.value("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "rope_scaling": _rope_scaling(g, a, head_dim),
        "torch_dtype": "float32",
        "use_cache": True,
    }
    rope_dims = int(a("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        d["partial_rotary_factor"] = rope_dims / head_dim
    d.update(_BUILDERS[arch](g, a, d))
    return d


def _rope_scaling(g: GGUFModel, a: _Meta, head_dim: int) -> dict[str, Any] | None:
    if "rope_freqs.weight" in g:
        return llama3_rope_scaling(g, f32_clean(a("rope.freq_base", 10000.0)), head_dim)
    kind = a("rope.scaling.type", None)
    factor = a("rope.scaling.factor", a("rope.scale_linear", None))
    if kind in (None, "none") and factor is None:
        return None
    if kind in ("linear", None):
        return {"rope_type": "linear", "factor": f32_clean(factor)}
    # Handed to the config as written; models/config.py names what it cannot compute.
    return {"rope_type": kind, "factor": f32_clean(factor or 1.0),
            "original_max_position_embeddings": a("rope.scaling.original_context_length", None)}  # fmt: skip


def _has_bias(g: GGUFModel, part: str) -> bool:
    return f"blk.0.{part}.bias" in g


def _llama(g: GGUFModel, a: _Meta, d: dict) -> dict:
    bias = _has_bias(g, "attn_q")
    common = {"attention_bias": bias, "mlp_bias": False}
    experts = int(a("expert_count", 0))
    if not experts:
        return {**common, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    return {**common, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": experts,
            "num_experts_per_tok": int(a("expert_used_count")), "sliding_window": None,
            "intermediate_size": int(a("expert_feed_forward_length", d["intermediate_size"]))}  # fmt: skip


def _qwen2(g: GGUFModel, a: _Meta, d: dict) -> dict:
    return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}


def _qwen3(g: GGUFModel, a: _Meta, d: dict) -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": _has_bias(g, "attn_q"),
            "use_sliding_window": False}  # fmt: skip


def _qwen_moe(g: GGUFModel, a: _Meta, d: dict, qwen3: bool) -> dict:
    out = {
        "num_experts": int(a("expert_count")), "num_experts_per_tok": int(a("expert_used_count")),
        "moe_intermediate_size": int(a("expert_feed_forward_length")), "decoder_sparse_step": 1,
        "mlp_only_layers": [], "use_sliding_window": False, "norm_topk_prob": qwen3,
    }  # fmt: skip
    if qwen3:
        return {**out, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                "attention_bias": _has_bias(g, "attn_q")}  # fmt: skip
    shared = a("expert_shared_feed_forward_length", None)
    if shared is None and "blk.0.ffn_up_shexp.weight" in g:
        shared = g.info("blk.0.ffn_up_shexp.weight").shape[0]
    return {**out, "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
            "shared_expert_intermediate_size": int(shared or 0), "qkv_bias": _has_bias(g, "attn_q")}  # fmt: skip


def _phi3(g: GGUFModel, a: _Meta, d: dict) -> dict:
    window = int(a("attention.sliding_window", 0))  # llama.cpp writes 0 for none
    out = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "sliding_window": window or None,
           "original_max_position_embeddings": int(a("rope.scaling.original_context_length",
                                                     d["max_position_embeddings"]))}  # fmt: skip
    if "rope_factors_long.weight" in g:
        out["rope_scaling"] = longrope_scaling(g, a("rope.scaling.attn_factor", None))
    return out


def _gemma_scale(d: dict, big_layers: int) -> int:
    """query_pre_attn_scalar as llama.cpp's f_attention_scale implies it."""
    if d["num_hidden_layers"] == big_layers:  # the 27B model
        return d["hidden_size"] // d["num_attention_heads"]
    return d["head_dim"]


def _layer_types(n: int, sliding: Callable[[int], bool]) -> list[str]:
    return ["sliding_attention" if sliding(i) else "full_attention" for i in range(n)]


def _gemma2(g: GGUFModel, a: _Meta, d: dict) -> dict:
    return {
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": _gemma_scale(d, 46),
        "attn_logit_softcapping": f32_clean(a("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": f32_clean(a("final_logit_softcapping", 30.0)),
        "sliding_window": int(a("attention.sliding_window", 4096)),
        "layer_types": _layer_types(d["num_hidden_layers"], lambda i: i % 2 == 0),
    }  # fmt: skip


def _gemma3(g: GGUFModel, a: _Meta, d: dict) -> dict:
    window = a("attention.sliding_window", None)
    pattern = a("attention.sliding_window_pattern", 6)
    n = d["num_hidden_layers"]
    if not window:
        types = _layer_types(n, lambda i: False)
    elif isinstance(pattern, list):  # one flag per layer: sliding or not
        if len(pattern) != n:
            raise GGUFError(f"gemma3.attention.sliding_window_pattern lists {len(pattern)} layers, not {n}")
        types = _layer_types(n, lambda i: bool(pattern[i]))
    else:
        types = _layer_types(n, lambda i: i % int(pattern) < int(pattern) - 1)
    cap = a("final_logit_softcapping", None)
    return {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": _gemma_scale(d, 62),
        "final_logit_softcapping": f32_clean(cap) if cap else None, "attn_logit_softcapping": None,
        "sliding_window": int(window) if window else None, "layer_types": types,
        "rope_local_base_freq": f32_clean(a("rope.freq_base_swa", 10000.0)),
        "rope_theta": f32_clean(a("rope.freq_base", 1000000.0)),
    }  # fmt: skip


_BUILDERS: dict[str, Callable[[GGUFModel, _Meta, dict], dict]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "phi3": _phi3, "gemma2": _gemma2, "gemma3": _gemma3,
    "qwen2moe": lambda g, a, d: _qwen_moe(g, a, d, qwen3=False),
    "qwen3moe": lambda g, a, d: _qwen_moe(g, a, d, qwen3=True),
}  # fmt: skip
assert set(_BUILDERS) == set(SUPPORTED_ARCHITECTURES)
