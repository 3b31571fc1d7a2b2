"""Convert a llama-architecture GGUF file into a Hugging Face model directory.

The output (config.json, model.safetensors in float32, tokenizer.json,
tokenizer_config.json, generation_config.json) loads both in our shard and in
`transformers`, which is our reference for correctness.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from pagemill.models.gguf_tokenizer import TokenizerSpec, build_tokenizer, tokenizer_config

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name -> HF name. `{n}` is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


@dataclass(frozen=True)
class LlamaHParams:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


def field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python value (str, int, float, bool or list)."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32_clean(x: float) -> float:
    # GGUF stores floats as f32; 9.999999747e-06 reads back as the 1e-05 that was meant.
    return float(str(np.float32(x)))


def read_hparams(reader: GGUFReader) -> LlamaHParams:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}: only {SUPPORTED_ARCHITECTURES} convert")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        # llama3-style rope scaling lives in that tensor; we'd silently drop it.
        raise ValueError("GGUF has rope_freqs.weight (scaled rope); converting it is not supported")

    def a(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    hidden = int(a("embedding_length"))
    heads = int(a("attention.head_count"))
    kv_heads = int(a("attention.head_count_kv", heads))
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    return LlamaHParams(
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_hidden_layers=int(a("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(a("attention.key_length", hidden // heads)),
        rms_norm_eps=_f32_clean(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32_clean(a("rope.freq_base", 10000.0)),
        max_position_embeddings=int(a("context_length", 2048)),
        vocab_size=int(a("vocab_size", n_tokens)),
        # llama.cpp omits output.weight when lm_head shares the embedding.
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field(reader, "tokenizer.ggml.padding_token_id"),
    )


def hf_config(hp: LlamaHParams) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_hidden_layers,
        "num_attention_heads": hp.num_attention_heads,
        "num_key_value_heads": hp.num_key_value_heads,
        "head_dim": hp.head_dim,
        "rms_norm_eps": hp.rms_norm_eps,
        "rope_theta": hp.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": hp.max_position_embeddings,
        "vocab_size": hp.vocab_size,
        "tie_word_embeddings": hp.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": hp.bos_token_id,
        "eos_token_id": hp.eos_token_id,
        "pad_token_id": hp.pad_token_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def generation_config(hp: LlamaHParams) -> dict[str, Any]:
    out = {"bos_token_id": hp.bos_token_id, "eos_token_id": hp.eos_token_id}
    if hp.pad_token_id is not None:
        out["pad_token_id"] = hp.pad_token_id
    return out


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rope re-layout of q_proj / k_proj rows.

    llama.cpp's converter turns each head's rows [first half | second half]
    (HF's rotate_half pairing) into interleaved pairs (GPT-J style), i.e. it
    views rows as (head, 2, head_dim/2) and swaps the last two axes. Here we
    view them as (head, head_dim/2, 2) and swap back. k uses the KV head count.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_f32(t: Any) -> np.ndarray:
    """Dequantize one reader tensor to float32 in HF (out_features, in_features) order."""
    # GGUF lists dims fastest-first; numpy wants them slowest-first.
    shape = tuple(int(d) for d in reversed(t.shape))
    if t.tensor_type == GGMLQuantizationType.F32:
        arr = np.asarray(t.data, dtype=np.float32)
    else:
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    return np.ascontiguousarray(arr.reshape(shape))


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def convert_tensors(reader: GGUFReader, hp: LlamaHParams) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        w = tensor_f32(t)
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_qk(w, hp.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_qk(w, hp.num_key_value_heads)
        out[name] = w
    expected = 2 + 9 * hp.num_hidden_layers + (0 if hp.tie_word_embeddings else 1)
    if len(out) != expected:
        raise ValueError(f"GGUF has {len(out)} convertible tensors, expected {expected}")
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_hf_dir(reader: GGUFReader, out: Path) -> None:
    """Write every file of the HF directory into `out` (which must exist)."""
    hp = read_hparams(reader)
    spec = TokenizerSpec(
        tokens=field(reader, "tokenizer.ggml.tokens"),
        token_types=field(reader, "tokenizer.ggml.token_type"),
        merges=field(reader, "tokenizer.ggml.merges", []),
        model=field(reader, "tokenizer.ggml.model"),
        pre=field(reader, "tokenizer.ggml.pre", "default"),
        bos_token_id=hp.bos_token_id,
        eos_token_id=hp.eos_token_id,
        pad_token_id=hp.pad_token_id,
        unk_token_id=field(reader, "tokenizer.ggml.unknown_token_id"),
        add_bos_token=bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=field(reader, "tokenizer.chat_template"),
        model_max_length=hp.max_position_embeddings,
    )
    build_tokenizer(spec).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(spec))
    _write_json(out / "config.json", hf_config(hp))
    _write_json(out / "generation_config.json", generation_config(hp))
    save_file(convert_tensors(reader, hp), str(out / "model.safetensors"), metadata={"format": "pt"})


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert `gguf_path` into the HF directory `out_dir` and return it.

    Written into a sibling temp dir and renamed into place, so a crash never
    leaves a half-written `out_dir`. An existing `out_dir` is replaced.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_hf_dir(GGUFReader(str(gguf_path)), tmp)
        if out_dir.exists():
            # rename() cannot replace a non-empty dir: move the old one aside first.
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
