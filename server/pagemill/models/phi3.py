"""Phi-3: the Llama layer, with q/k/v and gate/up already fused in the checkpoint.

Our parameters have the same names and, unsharded, the same row layout
([q | k | v], [gate | up]) as Phi-3's qkv_proj and gate_up_proj, so nothing
is split apart at load. Under tensor parallelism each rank's fused rows are
[its q heads | its kv heads' k | their v] and [its gate features | its up
features]: one checkpoint tensor fills several row ranges of one parameter,
each read from its own slice (checkpoint_targets). LongRoPE is the rotary's
business (layers.RotaryEmbedding); the layer itself is Llama's.
"""

from __future__ import annotations

from pagemill.models.llama import LlamaForCausalLM, WeightTarget
from pagemill.parallel.partition import Range


class Phi3ForCausalLM(LlamaForCausalLM):
    stacked_params: dict[str, tuple[str, int]] = {}  # the checkpoint's names are ours

    def checkpoint_targets(self, name: str) -> list[WeightTarget]:
        prefix = name.rpartition(".")[0]
        lay, cfg, d = self.layout, self.config, self.config.head_dim
        if prefix.endswith(".self_attn.qkv_proj"):
            q, kv = lay.heads.q, lay.heads.kv
            # (first head of each part in the checkpoint's rows, this rank's heads of that part)
            parts = [(0, q), (cfg.num_attention_heads, kv), (cfg.num_attention_heads + cfg.num_key_value_heads, kv)]
            targets, dest = [], 0
            for base, heads in parts:
                targets.append(WeightTarget(name, Range(dest, heads.size * d), 0,
                                            Range((base + heads.start) * d, heads.size * d)))  # fmt: skip
                dest += heads.size * d
            return targets
        if prefix.endswith(".mlp.gate_up_proj"):
            inter, full = lay.intermediate, cfg.intermediate_size
            return [
                WeightTarget(name, Range(0, inter.size), 0, inter),  # gate
                WeightTarget(name, Range(inter.size, inter.size), 0, Range(full + inter.start, inter.size)),  # up
            ]
        return super().checkpoint_targets(name)
