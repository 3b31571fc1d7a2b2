"""Model hyper-parameters read from a Hugging Face `config.json`.

Only what the Llama-family forward needs is kept. Both config layouts seen in
the wild are accepted: the classic `rope_theta` + `rope_scaling` keys and the
`rope_parameters` dict written by transformers >= 5.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from pagemill.models.gemma_config import (
    GEMMA_MODEL_TYPES, GemmaOptions, default_sliding_layers, gemma_options, global_rope_dict,
)  # fmt: skip
from pagemill.models.moe_config import MOE_MODEL_TYPES, MoeConfig, parse_moe

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", *MOE_MODEL_TYPES, *GEMMA_MODEL_TYPES)

# Rope variants whose inverse frequencies we compute (see layers.rope_inv_freq).
# "su" is the name early Phi-3 configs gave longrope.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "linear" | "llama3" | "longrope"
    factor: float
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192  # llama3 and longrope
    # longrope only: per-frequency divisors below / from original_max_position_embeddings
    # (see layers.RotaryEmbedding), and the factor cos/sin are multiplied by.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2 always)
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    # Mistral v0.1 / Qwen2 / Phi-3 / Gemma: a query sees only the last `sliding_window`
    # keys (itself included), in the layers layer_windows marks.
    sliding_window: int | None = None
    # Per layer: its window, or None for global attention (empty: every layer global).
    layer_windows: tuple[int | None, ...] = ()
    # o_proj carries a bias: HF's Llama and Qwen3 tie it to attention_bias, Qwen2/Mistral/Phi-3 never have one.
    o_proj_bias: bool = False
    # Qwen3, Gemma 3: an RMSNorm over head_dim on every q and k head, before rotary.
    qk_norm: bool = False
    # Mixtral / Qwen2-MoE / Qwen3-MoE: routed experts (models/moe.py); None: dense MLPs.
    moe: MoeConfig | None = None
    # Gemma 2 / 3 only (models/gemma.py): scale, soft caps, the local layers' rotary.
    gemma: GemmaOptions | None = None

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None where it attends to every earlier key."""
        return self.layer_windows[layer] if self.layer_windows else None

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{model_dir!r} has no config.json")
        with open(path) as f:
            config = json.load(f)
        generation = None
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                generation = json.load(f)
        return cls.from_dict(config, generation)

    @classmethod
    def from_dict(cls, d: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: pagemill runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu" and model_type not in GEMMA_MODEL_TYPES:  # Gemma: GeGLU, gemma_options checks
            raise ValueError(f"unsupported hidden_act {act!r}: only silu (SwiGLU MLP) is implemented")

        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        # Absent means multi-head attention (one kv head per query head).
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = int(d.get("head_dim") or hidden // heads)

        gemma = gemma_options(d, model_type, head_dim) if model_type in GEMMA_MODEL_TYPES else None
        # Gemma 3 lists rope per layer type: the global layers' is the model's rotary.
        rope_theta, rope_scaling = _parse_rope(global_rope_dict(d) if gemma else d, head_dim)

        sliding_window = d.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not d.get("use_sliding_window", False):
            sliding_window = None  # Qwen2/3 write a window but only use it when asked
        sliding_window = int(sliding_window) if sliding_window else None
        num_layers = int(d["num_hidden_layers"])
        if model_type == "qwen2":
            attention_bias = True  # Qwen2's config has no flag: its q/k/v projections always have a bias
        elif model_type == "qwen2_moe":
            attention_bias = bool(d.get("qkv_bias", True))  # its own name for Qwen2's q/k/v biases
        elif model_type == "phi3":
            attention_bias = False  # Phi-3's fused qkv_proj has none, whatever the config says
        else:
            attention_bias = bool(d.get("attention_bias", False))

        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            # Gemma's configs may leave it out: their classes default to tied.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma is not None)),
            attention_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            eos_token_ids=_eos_ids(d, generation),
            bos_token_id=d.get("bos_token_id"),
            sliding_window=sliding_window,
            layer_windows=layer_windows(d, model_type, sliding_window, num_layers),
            o_proj_bias=attention_bias and model_type in ("llama", "qwen3", "qwen3_moe", *GEMMA_MODEL_TYPES),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            moe=parse_moe(model_type, d),
            gemma=gemma,
        )


def all_layers_window(config: ModelConfig) -> int:
    """The window every layer shares, 0 when any layer is global (what the router may free behind)."""
    windows = set(config.layer_windows)
    return windows.pop() if len(windows) == 1 and None not in windows and config.layer_windows else 0


def layer_windows(d: dict[str, Any], model_type: str, window: int | None, num_layers: int
                  ) -> tuple[int | None, ...]:  # fmt: skip
    """Which layers slide, as transformers decides: `layer_types` where the config lists them
    (transformers >= 4.54 writes them for Qwen2/3 and Gemma), else Qwen's rule (layers from
    max_window_layers on), Gemma's interleaving, or, for Mistral and Phi-3, every layer."""
    if window is None:
        return ()
    types = d.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types lists {len(types)} layers, num_hidden_layers is {num_layers}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unsupported layer_types {sorted(unknown)}: pagemill runs sliding_attention and "
                             "full_attention layers")  # fmt: skip
        return tuple(window if t == "sliding_attention" else None for t in types)
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        first = int(d.get("max_window_layers", 28))
        return tuple(window if i >= first else None for i in range(num_layers))
    if model_type in GEMMA_MODEL_TYPES:
        return tuple(window if s else None for s in default_sliding_layers(d, model_type, num_layers))
    return (window,) * num_layers


def _parse_rope(d: dict[str, Any], head_dim: int) -> tuple[float, RopeScaling | None]:
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        scaling = dict(params)
        theta = float(scaling.pop("rope_theta", d.get("rope_theta", 10000.0)))
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else None
    # Phi-4-mini (model_type phi3) rotates only part of each head; we rotate all of it.
    partial = float((scaling or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor={partial}: pagemill applies rotary to the whole head")
    if not scaling:
        return theta, None
    # Older configs spell the key "type".
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}: pagemill implements {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    if rope_type in ("longrope", "su"):
        return theta, _parse_longrope(d, scaling, head_dim)
    return theta, RopeScaling(
        "llama3",
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _parse_longrope(d: dict[str, Any], scaling: dict[str, Any], head_dim: int) -> RopeScaling:
    """As transformers' _compute_longrope_parameters: Phi-3 keeps original_max_position_embeddings
    at the top level of config.json, transformers >= 5 inside rope_parameters."""
    original = scaling.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if original is None:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings")
    original = int(original)
    short, long = tuple(map(float, scaling["short_factor"])), tuple(map(float, scaling["long_factor"]))
    if len(short) != head_dim // 2 or len(long) != head_dim // 2:
        raise ValueError(
            f"longrope short_factor/long_factor have {len(short)}/{len(long)} entries, head_dim {head_dim} needs "
            f"{head_dim // 2}"
        )
    factor = scaling.get("factor")
    # Without an explicit factor the extension ratio is the context growth (Phi-3's configs).
    factor = float(factor) if factor is not None else int(d.get("max_position_embeddings", 2048)) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        "longrope", factor=factor, original_max_position_embeddings=original, short_factor=short,
        long_factor=long, attention_factor=float(attention),
    )  # fmt: skip


def _eos_ids(config: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    """Union of the eos ids of generation_config.json (first) and config.json.

    Chat models often list extra end-of-turn ids only in generation_config.json.
    """
    ids: list[int] = []
    for source in (generation or {}, config):
        value = source.get("eos_token_id")
        if value is None:
            continue
        for i in value if isinstance(value, list) else [value]:
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)
