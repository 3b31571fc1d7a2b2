"""Any causal LM transformers can run, over our paged KV pool (`--model-impl transformers`).

transformers' own modeling code computes everything but attention: we
register one attention function ("pagemill") in its AttentionInterface and
load the model with attn_implementation="pagemill". Each forward packs all
sequences of a step into one batch row (input_ids/position_ids [1, T], as
our native models do), passes our AttentionMetadata and the layer caches
down as keyword arguments (transformers forwards unknown kwargs to the
attention function), and the function writes the new keys/values into the
pool and runs our attention backend over the block tables. So continuous
batching, the paged pool, prefix caching and preemption work exactly as for
native models: the router cannot tell the difference.

With a custom attention function transformers builds no mask (the backend
masks causally per sequence) and we pass use_cache=False (the pool is the
cache). Rotary, norms, MLPs, embedding/residual multipliers all stay
transformers'. The output head is the model's own output embedding; the
scalings some CausalLM heads apply after it (Granite's logits_scaling,
Cohere's logit_scale, final_logit_softcapping) are applied from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from pagemill.attention.backend import AttentionBackend
from pagemill.attention.metadata import AttentionMetadata
from pagemill.models.config import ModelConfig
from pagemill.parallel.group import ParallelGroup

ATTN_IMPLEMENTATION = "pagemill"
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PagedStep:
    """What the attention function needs of one forward, passed down through transformers' kwargs."""

    meta: AttentionMetadata
    kv_caches: Sequence[KVCache]
    backend: AttentionBackend


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                    pagemill_step: PagedStep | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention signature: query [1, heads, T, d], key/value [1, kv_heads, T, d]
    (rotated) -> ([1, T, heads, d], no weights)."""
    if pagemill_step is None:
        raise RuntimeError("pagemill attention called outside a pagemill forward (no paged step given)")
    for unsupported in ("sliding_window", "softcap"):
        if kwargs.get(unsupported):
            raise NotImplementedError(f"{type(module).__name__} asks for {unsupported}={kwargs[unsupported]}, "
                                      "which pagemill's paged attention does not apply")  # fmt: skip
    step = pagemill_step
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, heads, d]
    k_cache, v_cache = step.kv_caches[module.layer_idx]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    step.backend.write_kv(k, v, k_cache, v_cache, step.meta.slot_mapping)
    if step.meta.is_prefill:
        out = step.backend.prefill(q, k, v, k_cache, v_cache, step.meta, scale)
    else:
        out = step.backend.decode(q, k_cache, v_cache, step.meta, scale)
    return out[None], None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


class TransformersCausalLM(nn.Module):
    """A transformers CausalLM behind our model interface (forward over packed tokens, compute_logits)."""

    impl = "transformers"

    def __init__(self, hf: nn.Module, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.hf, self.config, self._backend = hf, config, backend
        device = next(hf.parameters()).device
        self.group = ParallelGroup.single(device)
        text = hf.config.get_text_config()
        # Post-head scalings of some CausalLM forwards (see the module docstring).
        self.logit_divisor = float(getattr(text, "logits_scaling", 1.0) or 1.0)
        self.logit_scale = float(getattr(text, "logit_scale", 1.0) or 1.0)
        self.softcap = getattr(text, "final_logit_softcapping", None)

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def backend(self) -> AttentionBackend:
        return self._backend

    def set_backend(self, backend: AttentionBackend) -> None:
        self._backend = backend

    def pack_weights(self, cpu_kernels: bool = True) -> int:
        return 0  # transformers' linears are plain nn.Linear

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: Sequence[KVCache], lora=None) -> torch.Tensor:  # fmt: skip
        """input_ids/positions [T] -> final hidden states [T, hidden]. lora: always None (Warmup
        refuses adapters with this implementation)."""
        if lora is not None:
            raise RuntimeError("LoRA adapters need the native model implementation")
        step = PagedStep(attn_metadata, kv_caches, self._backend)
        out = self.hf.get_decoder()(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                    pagemill_step=step)  # fmt: skip
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_logits(hidden).float()

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits in the head's dtype (LlamaForCausalLM.head_logits)."""
        logits = self.hf.get_output_embeddings()(hidden)
        if self.logit_divisor != 1.0:
            logits = logits / self.logit_divisor
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def transformers_model_config(model_dir: str) -> ModelConfig:
    """The fields of ModelConfig the shard uses (KV pool shape, vocabulary, EOS ids), from transformers'
    parsed config (its defaults apply where config.json is silent)."""
    import json
    import os

    from transformers import AutoConfig

    from pagemill.models.config import _eos_ids

    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    gen_path = os.path.join(model_dir, "generation_config.json")
    generation = json.load(open(gen_path)) if os.path.isfile(gen_path) else None
    heads = int(text.num_attention_heads)
    return ModelConfig(
        model_type=text.model_type, vocab_size=int(text.vocab_size), hidden_size=int(text.hidden_size),
        intermediate_size=int(getattr(text, "intermediate_size", 0) or 0),
        num_hidden_layers=int(text.num_hidden_layers), num_attention_heads=heads,
        num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6) or 1e-6), rope_theta=0.0, rope_scaling=None,
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 2048) or 2048),
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)), attention_bias=False, mlp_bias=False,
        eos_token_ids=_eos_ids(raw, generation), bos_token_id=raw.get("bos_token_id"),
    )  # fmt: skip


def load_transformers_model(model_dir: str, dtype: torch.dtype, device: torch.device,
                            backend: AttentionBackend) -> tuple[TransformersCausalLM, ModelConfig]:  # fmt: skip
    from transformers import AutoModelForCausalLM

    config = transformers_model_config(model_dir)
    register_attention()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                              device_map=str(device))  # fmt: skip
    return TransformersCausalLM(hf.eval().requires_grad_(False), config, backend), config
