"""What Gemma 2 and Gemma 3 (text) configs add to the Llama family's hyper-parameters.

Both configs spell the MLP activation `hidden_activation` (GeGLU with the
tanh-approximated GELU). Gemma 3 gives its local (sliding-window) layers
their own rotary base: transformers >= 5 writes `rope_parameters` as one
dict per layer type, older configs `rope_theta` (global layers) plus
`rope_local_base_freq`, with `rope_scaling` applying to global layers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# transformers' ACT2FN names for GELU with the tanh approximation (what Gemma checkpoints ship).
GEGLU_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


@dataclass(frozen=True)
class GemmaOptions:
    # Attention scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
    query_pre_attn_scalar: float
    # score -> cap * tanh(score / cap) before the softmax (Gemma 2; None: off).
    attn_logit_softcapping: float | None
    # logits -> cap * tanh(logits / cap) (Gemma 2; None: off).
    final_logit_softcapping: float | None
    # Rotary of the sliding-window layers (Gemma 3's local base; Gemma 2: the global one).
    local_rope_theta: float
    local_rope_scaling: Any  # config.RopeScaling | None


def global_rope_dict(d: dict[str, Any]) -> dict[str, Any]:
    """d with its rope keys replaced by those of the global (full-attention) layers, so that
    config._parse_rope reads them as any other model's."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return {**d, "rope_parameters": params["full_attention"]}
    return d


def local_rope_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The same for Gemma 3's sliding-window layers: their own base, never the global scaling."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "sliding_attention" in params:
        return {**d, "rope_parameters": params["sliding_attention"], "rope_scaling": None}
    theta = d.get("rope_local_base_freq", 10000.0)
    return {**d, "rope_parameters": None, "rope_scaling": None, "rope_theta": theta}


def gemma_options(d: dict[str, Any], model_type: str, head_dim: int) -> GemmaOptions:
    from pagemill.models.config import _parse_rope  # config imports this module

    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEGLU_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_activation {act!r} for {model_type}: pagemill implements "
                         f"{', '.join(GEGLU_ACTIVATIONS)} (GeGLU)")  # fmt: skip
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type} with use_bidirectional_attention (an embedding model) is not a causal LM")
    if model_type == "gemma3_text":
        local_theta, local_scaling = _parse_rope(local_rope_dict(d), head_dim)
    else:
        local_theta, local_scaling = _parse_rope(d, head_dim)

    def optional(key: str) -> float | None:
        value = d.get(key)
        return float(value) if value else None

    return GemmaOptions(
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", head_dim)),
        attn_logit_softcapping=optional("attn_logit_softcapping"),
        final_logit_softcapping=optional("final_logit_softcapping"),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


def default_sliding_layers(d: dict[str, Any], model_type: str, num_layers: int) -> list[bool]:
    """Which layers slide when the config has no layer_types (as transformers' defaults):
    Gemma 2 every other layer from the first, Gemma 3 all but every sliding_window_pattern-th."""
    pattern = 2 if model_type == "gemma2" else int(d.get("sliding_window_pattern", 6))
    return [bool((i + 1) % pattern) for i in range(num_layers)]
