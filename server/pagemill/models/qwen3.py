"""Qwen3: the Llama layer plus an RMSNorm over head_dim on each q and k head.

As transformers' Qwen3Attention: project, normalise each head (q_norm for
query heads, k_norm for key heads, one weight of size head_dim each), then
rotary. The fused CPU decode kernel has no q/k norm, so FusedDecoder.build
declines these layers (their parameters are not all in its table) and
decode takes the module path.
"""

from __future__ import annotations

import torch

from pagemill.models.layers import RMSNorm
from pagemill.models.llama import Attention, LlamaForCausalLM


class Qwen3Attention(Attention):
    def __init__(self, config, backend, layout, group) -> None:
        super().__init__(config, backend, layout, group)
        # Replicated under tensor parallelism: each rank normalises its own whole heads.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def before_rotary(self, qk: torch.Tensor) -> torch.Tensor:
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
