"""Writes a Hugging Face model directory as a GGUF file the way llama.cpp's convert_hf_to_gguf.py
does (the layout and metadata conventions only), with weights quantized to chosen types.

What the converter does per architecture, and the loader must undo: llama-arch files (Llama,
Mistral, Mixtral) permute q/k rows for interleaved rotary; Gemma stores norms as 1 + w; Phi-3
keeps its fused qkv_proj / gate_up_proj as attn_qkv / ffn_up; MoE experts are stacked
[n_expert, N, K] per projection. Tied embeddings have no output.weight. `parts` > 1 splits the
file as gguf-split does (`-0000i-of-0000N.gguf`, split.* keys, metadata in the first part).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter, RopeScalingType
from gguf_quants import quantize
from gguf_vocab import Vocab
from safetensors.numpy import load_file

ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
        "gemma2": "gemma2", "gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}  # fmt: skip
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up",
          "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}  # fmt: skip
_GEMMA = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
QType = T | Callable[[str, tuple[int, ...]], T]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k re-layout (rotate_half pairs -> interleaved pairs), rows first."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(cfg: dict, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensors -> GGUF name -> float32 array as llama.cpp's converter writes them."""
    arch = ARCH[cfg["model_type"]]
    names = _GEMMA if arch.startswith("gemma") else _LAYER
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, w in weights.items():
        w = w.astype(np.float32)
        if (m := _EXPERT.fullmatch(name)) is not None:
            experts.setdefault((int(m[1]), _EXPERT_PROJ[m[3]]), {})[int(m[2])] = w
            continue
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1.0
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = w  # fmt: skip
            continue
        layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        module, _, leaf = rest.rpartition(".")
        gname = names[module]
        if arch == "llama" and gname in ("attn_q", "attn_k"):
            w = permute(w, cfg["num_attention_heads"] if gname == "attn_q" else cfg["num_key_value_heads"])
        if gname == "ffn_gate_inp_shexp":
            w = w.reshape(-1)
        out[f"blk.{layer}.{gname}.{leaf}"] = w
    for (layer, proj), by_expert in sorted(experts.items()):
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _metadata(w: GGUFWriter, cfg: dict, arch: str) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    if "head_dim" in cfg or arch.startswith("gemma"):  # TextModel's rule; Gemma's converters always write them
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        glob, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
        w.add_rope_freq_base(glob.get("rope_theta", 1e6))
        w.add_rope_freq_base_swa(local.get("rope_theta", 10000.0))
        if glob.get("rope_type") == "linear":
            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(glob["factor"])
        if cfg.get("sliding_window"):
            w.add_sliding_window(cfg["sliding_window"])
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    else:
        w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
        w.add_rope_scaling_orig_ctx_len(cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _vocab(w: GGUFWriter, v: Vocab) -> None:
    w.add_tokenizer_model(v.model)
    w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.token_types)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    if v.merges:
        w.add_token_merges(v.merges)
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                     ("pad", w.add_pad_token_id)):  # fmt: skip
        if key in v.ids:
            add(v.ids[key])
    w.add_add_bos_token(v.add_bos)
    if v.chat_template:
        w.add_chat_template(v.chat_template)


# What llama-quantize writes instead of a k-quant for rows that are not whole 256-value blocks.
K_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def default_types(qtype: T) -> Callable[[str, tuple[int, ...]], T]:
    """qtype for every matrix, F32 for vectors (norms, biases) as llama.cpp keeps them. A matrix
    whose rows are not whole blocks gets llama-quantize's fallback type (k-quants), else F16."""

    def choose(name: str, shape: tuple[int, ...]) -> T:
        if len(shape) < 2:
            return T.F32
        t = qtype if shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0 else K_FALLBACK.get(qtype, T.F16)
        return t if shape[-1] % GGML_QUANT_SIZES[t][0] == 0 else T.F16

    return choose


def write_gguf(model_dir: str | Path, out: str | Path, vocab: Vocab, qtype: QType = T.Q8_0, parts: int = 1,
               name: str = "tiny") -> list[Path]:  # fmt: skip
    """Writes `model_dir` (config.json + model.safetensors) to `out` (or its split parts)."""
    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = ARCH[cfg["model_type"]]
    choose = qtype if callable(qtype) else default_types(qtype)
    tensors = gguf_tensors(cfg, load_file(str(model_dir / "model.safetensors")))
    writer = GGUFWriter(out, arch, split_max_tensors=-(-len(tensors) // parts) if parts > 1 else 0)
    writer.add_name(name)
    _metadata(writer, cfg, arch)
    _vocab(writer, vocab)
    for gname, w in tensors.items():
        t = choose(gname, w.shape)
        writer.add_tensor(gname, quantize(w, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if parts == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, parts + 1)]
