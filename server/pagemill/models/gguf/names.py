"""GGUF tensor names -> Hugging Face parameter names, per architecture, with the inverse of what
llama.cpp's converter (convert_hf_to_gguf.py) did to each tensor on the way in:

- llama (Llama, Mistral, Mixtral): q and k rows re-laid from rotate_half pairs to interleaved
  pairs ("permute"); undone by the inverse row permutation (exact on quantized rows too: a row's
  blocks move whole);
- gemma2 / gemma3: every norm weight stored as 1 + w (Gemma's RMSNorm scales by 1 + w);
- phi3: attn_qkv and ffn_up (gate | up) are Phi-3's own fused qkv_proj and gate_up_proj;
- MoE: the experts of a layer stacked into one [n_expert, N, K] tensor per projection
  (ffn_gate_exps, ffn_up_exps, ffn_down_exps), the router as ffn_gate_inp, Qwen2-MoE's shared
  expert as ffn_*_shexp and its gate ffn_gate_inp_shexp (a vector: one output feature).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.types import GGUFError

# Transforms (Weight.transform).
PERMUTE_Q, PERMUTE_K, NORM_PLUS_ONE, ROW_VECTOR = "permute_q", "permute_k", "norm_plus_one", "row_vector"

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors that the config reads (rope frequencies), not weights.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}  # fmt: skip
_PHI3_LAYER = {**_LAYER, "ffn_up": "mlp.gate_up_proj"}
# MoE: (block name, expert projection names for gate, up, down)
_MIXTRAL = ("block_sparse_moe", ("w1", "w3", "w2"))
_QWEN_MOE = ("mlp", ("gate_proj", "up_proj", "down_proj"))
_SHARED = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
           "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}  # fmt: skip
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class Weight:
    """HF parameter `hf` comes from GGUF tensor `gguf` (its `expert`-th slice along the first
    dimension when not None), undoing `transform` (None: as stored)."""

    hf: str
    gguf: str
    expert: int | None = None
    transform: str | None = None


def weight_plan(g: GGUFModel, config: dict) -> list[Weight]:
    """Every HF parameter the file holds, in file order; GGUFError on a tensor the architecture
    does not have."""
    arch = g.architecture
    moe = _MIXTRAL if config["model_type"] == "mixtral" else _QWEN_MOE
    layer_names = _GEMMA_LAYER if arch in ("gemma2", "gemma3") else _PHI3_LAYER if arch == "phi3" else _LAYER
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    out: list[Weight] = []
    for name in g.tensors:
        if name in CONFIG_TENSORS:
            continue
        out += _weights_of(name, arch, layer_names, moe, experts)
    return out


def _weights_of(name: str, arch: str, layer_names: dict, moe: tuple, experts: int) -> list[Weight]:
    gemma = arch in ("gemma2", "gemma3")
    stem, _, leaf = name.rpartition(".")
    if stem in _GLOBAL and leaf == "weight":
        norm = gemma and stem == "output_norm"
        return [Weight(f"{_GLOBAL[stem]}.weight", name, transform=NORM_PLUS_ONE if norm else None)]
    m = _BLOCK.match(name)
    if m is None:
        raise GGUFError(f"unexpected GGUF tensor {name!r} for architecture {arch!r}")
    layer, part, leaf = m[1], m[2], m[3]
    prefix = f"model.layers.{layer}"
    block, (gate, up, down) = moe
    if part in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") and experts and leaf == "weight":
        proj = {"ffn_gate_exps": gate, "ffn_up_exps": up, "ffn_down_exps": down}[part]
        return [Weight(f"{prefix}.{block}.experts.{e}.{proj}.weight", name, e) for e in range(experts)]
    if part == "ffn_gate_inp" and experts:
        return [Weight(f"{prefix}.{block}.gate.{leaf}", name)]
    if part in _SHARED:
        return [Weight(f"{prefix}.{_SHARED[part]}.{leaf}", name,
                       transform=ROW_VECTOR if part == "ffn_gate_inp_shexp" else None)]  # fmt: skip
    if part not in layer_names:
        raise GGUFError(f"unexpected GGUF tensor {name!r} for architecture {arch!r}")
    transform = None
    if gemma and part.endswith("norm"):
        transform = NORM_PLUS_ONE
    elif arch == "llama" and part in ("attn_q", "attn_k"):
        transform = PERMUTE_Q if part == "attn_q" else PERMUTE_K
    return [Weight(f"{prefix}.{layer_names[part]}.{leaf}", name, transform=transform)]


def unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's rope re-layout of q/k rows (numpy array or torch tensor, rows first).

    llama.cpp's converter turns each head's rows [first half | second half] (HF's rotate_half
    pairing) into interleaved pairs: it views the rows as (head, 2, head_dim/2) and swaps the
    last two axes. Viewing them as (head, head_dim/2, 2) and swapping back restores HF's order.
    Rows move whole, so this applies as well to a quantized tensor's rows of blocks.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"cannot un-permute {rows} rows into {n_heads} heads of pairs")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
