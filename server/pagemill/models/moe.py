"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE.

The attention is the Llama layer's (Qwen3-MoE: Qwen3's, with q/k norms); the
MLP of every sparse layer (MoeConfig.sparse_layers) is a SparseMoeBlock:

  router: softmax over `gate(x)` in float32, the top-k experts per token,
          optionally renormalised to sum to 1 (Mixtral always, Qwen with
          norm_topk_prob);
  experts: SwiGLU MLPs; token t's output is sum_k weight_tk * expert_k(x_t);
  shared expert (Qwen2-MoE): one more SwiGLU MLP every token goes through,
          scaled by sigmoid(shared_expert_gate(x)).

Experts run batched per step: the (token, expert) assignments are sorted by
expert id and each expert multiplies the rows routed to it in one matmul, so
the Python loop is over the experts hit in this step, never over tokens.
That needs the per-expert counts on the host (one sync per layer), which a
CUDA graph cannot capture: under capture every expert runs on every row with
a weight that is zero where the row was not routed to it (same result, more
flops, no data-dependent shape).

Tensor parallelism shards each expert's intermediate dimension exactly like
the dense MLP (gate/up rows, down columns of this rank's slice), so every
rank routes every token (the router weight is replicated) and computes a
partial sum for all of them; one all-reduce per block adds the partials of
routed and shared experts together.

Checkpoints keep one tensor per expert (as on the Hub and as transformers
writes them): Mixtral's `block_sparse_moe.experts.E.w1/w3/w2`, Qwen's
`mlp.experts.E.gate_proj/up_proj/down_proj`; our module is `mlp` in both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.models.config import ModelConfig
from pagemill.models.layers import MLP
from pagemill.models.llama import LlamaForCausalLM, WeightTarget
from pagemill.models.moe_config import MoeConfig
from pagemill.models.packed_linear import pack_all
from pagemill.models.qwen3 import Qwen3Attention
from pagemill.parallel.group import ParallelGroup
from pagemill.parallel.partition import Range, split


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, group: ParallelGroup) -> None:
        super().__init__()
        moe: MoeConfig = config.moe
        h, rank, world = config.hidden_size, group.rank, group.world_size
        self.moe, self.group = moe, group
        self.expert_slice = split(moe.intermediate_size, world, rank)
        self.gate = nn.Linear(h, moe.num_experts, bias=False)  # the router; replicated, never quantized
        # Each expert's down_proj sums only this rank's features: the block all-reduces once for all of them.
        local = ParallelGroup.single(group.device)
        self.experts = nn.ModuleList(MLP(config, self.expert_slice, local) for _ in range(moe.num_experts))
        self.shared_slice: Range | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_slice = split(moe.shared_expert_intermediate_size, world, rank)
            self.shared_expert = MLP(config, self.shared_slice, local)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k], expert ids [T, k]), as transformers' top-k routers."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.moe.weights_in_model_dtype else weights), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        out = self.all_experts(x, weights, ids) if capturing else self.grouped_experts(x, weights, ids)
        if self.shared_slice is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.group.world_size == 1 else self.group.all_reduce(out)

    def grouped_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each expert hit in this step runs once, on all rows routed to it."""
        flat = ids.flatten()  # assignment a = t * k + j
        order = flat.argsort(stable=True)  # assignments grouped by expert, tokens ascending within each
        rows = order // ids.shape[1]  # the token of each sorted assignment
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()  # the one host sync
        chunks = x.index_select(0, rows).split(counts)
        out = torch.cat([self.experts[e](c) for e, c in enumerate(chunks) if counts[e]])
        out = out * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, rows, out.to(x.dtype))

    def all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every row, weighted by zero where the row was not routed to it (graph-safe)."""
        dense = torch.zeros(x.shape[0], self.moe.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += (expert(x) * dense[:, e, None]).to(x.dtype)
        return out


@dataclass(frozen=True)
class ExpertNames:
    """How a family's checkpoint names a sparse layer's block and an expert's projections."""

    block: str
    gate: str
    up: str
    down: str


QWEN_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
_EXPERT = re.compile(r"experts\.(\d+)\.(\w+)\.weight")


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE (and the base of the other two)."""

    names: ExpertNames = QWEN_NAMES

    def mlp_for_layer(self, index: int) -> nn.Module | None:
        return SparseMoeBlock(self.config, self.group) if index in self.config.moe.sparse_layers else None

    def pack_weights(self, cpu_kernels: bool = True) -> int:
        """The experts' linears are packed like any other; the fused decode layer computes a dense
        MLP only, so MoE decode takes the module path."""
        from pagemill.models.gguf.linear import pack_gguf

        self.model.fused = None
        return pack_all(self, cpu_kernels) + pack_gguf(self, cpu_kernels)

    def checkpoint_names(self) -> set[str]:
        names = super().checkpoint_names()
        n = self.names
        for i in self.config.moe.sparse_layers:
            block: SparseMoeBlock = self.model.layers[i].mlp
            names = {x for x in names if not x.startswith(f"model.layers.{i}.mlp.")}
            hf = f"model.layers.{i}.{n.block}"
            names.add(f"{hf}.gate.weight")
            names |= {f"{hf}.experts.{e}.{p}.weight" for e in range(len(block.experts)) for p in (n.gate, n.up, n.down)}
            if block.shared_slice is not None:
                names |= {f"{hf}.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
                names.add(f"{hf}.shared_expert_gate.weight")
        return names

    def checkpoint_targets(self, name: str) -> list[WeightTarget]:
        m = re.fullmatch(rf"model\.layers\.(\d+)\.{self.names.block}\.(.+)", name)
        if m is None or int(m[1]) not in self.config.moe.sparse_layers:
            return super().checkpoint_targets(name)
        ours = f"model.layers.{m[1]}.mlp"
        rest, block = m[2], self.model.layers[int(m[1])].mlp
        if rest in ("gate.weight", "shared_expert_gate.weight"):
            return [WeightTarget(f"{ours}.{rest}", None, 0, None)]  # replicated
        if rest.startswith("shared_expert."):
            proj = rest.split(".")[1]
            return [_swiglu_target(f"{ours}.shared_expert", proj, ("gate_proj", "up_proj", "down_proj"),
                                   block.shared_slice)]  # fmt: skip
        e = _EXPERT.fullmatch(rest)
        if e is None:
            return [WeightTarget(name, None, 0, None)]  # not ours: the loader warns and skips it
        n = self.names
        return [_swiglu_target(f"{ours}.experts.{e[1]}", e[2], (n.gate, n.up, n.down), block.expert_slice)]


def _swiglu_target(ours: str, proj: str, hf: tuple[str, str, str], inter: Range) -> WeightTarget:
    """Checkpoint projection `proj` (one of hf = gate, up, down names) of one SwiGLU MLP whose
    intermediate slice on this rank is `inter` -> rows of our gate_up_proj, or down_proj's columns."""
    if proj == hf[2]:
        return WeightTarget(f"{ours}.down_proj.weight", None, 1, inter)
    if proj not in hf:
        return WeightTarget(f"{ours}.{proj}.weight", None, 0, None)  # no such parameter: the loader warns
    part = hf.index(proj)
    return WeightTarget(f"{ours}.gate_up_proj.weight", Range(part * inter.size, inter.size), 0, inter)


class MixtralForCausalLM(MoeForCausalLM):
    names = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


class Qwen3MoeForCausalLM(MoeForCausalLM):
    attention_cls = Qwen3Attention
