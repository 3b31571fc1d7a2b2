"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over packed tokens.

The module tree and parameter names mirror Hugging Face's LlamaForCausalLM,
so a checkpoint's state dict loads without renaming. Unlike HF there is no
batch dimension: all sequences of a step are packed into one [T] axis and
attention finds each sequence's history in the paged KV pool.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pagemill.attention.backend import AttentionBackend
from pagemill.attention.metadata import AttentionMetadata
from pagemill.models.config import ModelConfig
from pagemill.models.layers import MLP, RMSNorm, RotaryEmbedding, apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache) of one layer


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.backend = backend
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            out = self.backend.prefill(q, k, v, k_cache, v_cache, meta, self.scale)
        else:
            out = self.backend.decode(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches: Sequence[KVCache]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # One cos/sin for all layers: positions do not change inside a forward.
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, kv_cache)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        if backend is None:
            from pagemill.attention.torch_backend import TorchAttentionBackend

            backend = TorchAttentionBackend()
        self.config = config
        self.model = LlamaModel(config, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Shares the embedding with the output projection when the config says so.

        Must be re-run after anything that re-creates parameters (to_empty).
        """
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_backend(self, backend: AttentionBackend) -> None:
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    @property
    def backend(self) -> AttentionBackend:
        return self.model.layers[0].self_attn.backend

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: Sequence[KVCache],
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()
