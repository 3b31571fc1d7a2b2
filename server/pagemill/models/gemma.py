"""Gemma 2 and Gemma 3 text models over the Llama family's attention and linears.

As transformers' Gemma2/Gemma3 modeling, operation for operation:
- RMSNorm scales by (1 + w) (the checkpoint stores w around 0), in float32;
- the embedding is multiplied by sqrt(hidden_size) (in the weights' dtype);
- each layer normalises before and after attention and before and after the
  MLP (four norms), and its MLP is GeGLU (tanh-approximated GELU of the gate);
- attention scales by query_pre_attn_scalar ** -0.5; Gemma 2 caps its scores
  (attn_logit_softcapping, applied by the backends) and its final logits;
- layers alternate between sliding-window (local) and global attention
  (config.layer_windows); Gemma 3 normalises each q and k head (as Qwen3)
  and rotates its local layers with their own base, its global layers with
  the model's rope (and rope scaling).

Tensor parallelism is the Llama layer's: heads and MLP features split by
rank, norms replicated. The fused CPU decode layer for float and int8 weights
does not apply (it has none of the extra norms); a model holding GGUF blocks
decodes through fused_decode.GGUFFusedDecoder, which has them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.attention.backend import AttentionBackend
from pagemill.attention.metadata import AttentionMetadata
from pagemill.models.config import ModelConfig
from pagemill.models.fused_decode import GGUFFusedDecoder
from pagemill.models.layers import MLP, RotaryEmbedding
from pagemill.models.llama import Attention, KVCache, LlamaForCausalLM
from pagemill.parallel.embedding import VocabParallelEmbedding
from pagemill.parallel.group import ParallelGroup
from pagemill.parallel.partition import TPLayout


class GemmaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise and scale in float32, then cast (Llama casts before scaling; Gemma after).
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GegluMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaAttention(Attention):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layout: TPLayout, group: ParallelGroup):
        super().__init__(config, backend, layout, group)
        self.scale = config.gemma.query_pre_attn_scalar**-0.5
        self.softcap = config.gemma.attn_logit_softcapping
        self.qk_norm = config.qk_norm
        if self.qk_norm:  # Gemma 3; replicated under tensor parallelism, as Qwen3's
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def before_rotary(self, qk: torch.Tensor) -> torch.Tensor:
        if not self.qk_norm:
            return qk
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layout: TPLayout, group: ParallelGroup,
                 attention_cls: type[Attention]) -> None:  # fmt: skip
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attention_cls(config, backend, layout, group)
        self.mlp = GegluMLP(config, layout.intermediate, group)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layout: TPLayout, group: ParallelGroup,
                 attention_cls: type[Attention]) -> None:  # fmt: skip
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(layout.vocab, config.hidden_size, group)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, backend, layout, group, attention_cls) for _ in range(config.num_hidden_layers)
        )
        for i, layer in enumerate(self.layers):
            layer.self_attn.sliding_window = config.window_of(i)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        local = dataclasses.replace(config, rope_theta=config.gemma.local_rope_theta,
                                    rope_scaling=config.gemma.local_rope_scaling)  # fmt: skip
        self.local_rotary = RotaryEmbedding(local)
        self.fused = None  # GGUF weights only (see the module docstring); set by pack_weights

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches: Sequence[KVCache]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers multiplies by the scale cast to the weights' dtype.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        # The compiled whole-layer decoder knows no adapters: steps with adapter rows take the per-op path.
        ctx = getattr(self, "lora_context", None)
        adapters = ctx is not None and ctx.batch is not None
        if not adapters and self.fused is not None and self.fused.applies(x, meta, kv_caches):
            cos, sin = self.rotary.cos_sin(positions, torch.float32)
            cos_local, sin_local = self.local_rotary.cos_sin(positions, torch.float32)
            return self.norm(self.fused(x, cos, sin, meta, kv_caches, cos_local, sin_local))
        rotary = {False: self.rotary.cos_sin(positions, x.dtype), True: self.local_rotary.cos_sin(positions, x.dtype)}
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = rotary[layer.self_attn.sliding_window is not None]
            x = layer(x, cos, sin, meta, kv_cache)
        return self.norm(x)


class GemmaForCausalLM(LlamaForCausalLM):
    attention_cls = GemmaAttention
    model_cls = GemmaModel

    def pack_weights(self, cpu_kernels: bool = True) -> int:
        n = super().pack_weights(cpu_kernels)
        if not isinstance(self.model.fused, GGUFFusedDecoder):
            self.model.fused = None  # the float/int8 kernel's layer is Llama's, not Gemma's
        return n

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.gemma.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
