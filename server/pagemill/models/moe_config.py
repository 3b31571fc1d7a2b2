"""Mixture-of-experts hyper-parameters (Mixtral, Qwen2-MoE, Qwen3-MoE) read from `config.json`.

The three families name the same things differently; this is the one place
that knows how, so models/moe.py sees a single shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # experts each token is routed to
    intermediate_size: int  # of each routed expert
    # Renormalise the top-k softmax probabilities to sum to 1 (Mixtral always; Qwen: norm_topk_prob).
    norm_topk_prob: bool
    # Qwen casts the top-k weights to the model dtype before scaling expert outputs; Mixtral
    # scales in float32 and casts the product. Equal in float32, a rounding apart in bf16.
    weights_in_model_dtype: bool
    sparse_layers: frozenset[int]  # layers whose MLP is the expert block; the others are dense
    # Qwen2-MoE: one expert every token goes through, scaled by sigmoid(shared_expert_gate(x)); 0: none.
    shared_expert_intermediate_size: int = 0


def parse_moe(model_type: str, d: dict[str, Any]) -> MoeConfig | None:
    """The MoE part of config `d` (None for a dense model type)."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    layers = int(d["num_hidden_layers"])
    if model_type == "mixtral":
        return MoeConfig(
            num_experts=int(d.get("num_local_experts", 8)), top_k=int(d.get("num_experts_per_tok", 2)),
            intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True, weights_in_model_dtype=False,
            sparse_layers=frozenset(range(layers)),
        )  # fmt: skip
    # Qwen: a layer is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th one.
    # Hub configs say num_experts; transformers >= 5 writes Qwen3-MoE's as num_local_experts.
    experts = int(d.get("num_experts", d.get("num_local_experts", 0)))
    step = int(d.get("decoder_sparse_step", 1))
    dense = set(d.get("mlp_only_layers") or [])
    sparse = frozenset(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return MoeConfig(
        num_experts=experts, top_k=int(d.get("num_experts_per_tok", 1)),
        intermediate_size=int(d["moe_intermediate_size"]), norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        weights_in_model_dtype=True, sparse_layers=sparse,
        # Qwen2-MoE always has one (transformers' default size where config.json omits it), Qwen3-MoE never.
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 5632))
        if model_type == "qwen2_moe" else 0,
    )  # fmt: skip
