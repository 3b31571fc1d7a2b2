"""Column- and row-parallel linears (Megatron-LM's split of a transformer layer).

Column-parallel (q/k/v, gate/up): each rank holds some output rows of the
weight and produces its slice of the output features; the slice is consumed
locally (attention over the rank's heads, SwiGLU over its intermediate
features), so nothing is communicated.

Row-parallel (o_proj, down_proj): each rank holds the input columns matching
the slice it produced, computes a partial product and the partial products are
summed by one all-reduce. A bias is added once, after the sum (adding it on
every rank would count it world_size times).

Both keep nn.Linear's parameter names and the CPU-packed fast path of
PackedLinear; which checkpoint rows/columns fill them is the loader's business
(LlamaForCausalLM.checkpoint_target).
"""

from __future__ import annotations

import torch

from pagemill.models.packed_linear import PackedLinear
from pagemill.parallel.group import ParallelGroup


class ColumnParallelLinear(PackedLinear):
    """out_features is this rank's share; output stays sharded (no gather)."""


class RowParallelLinear(PackedLinear):
    """in_features is this rank's share; output is the full, all-reduced result."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return super().forward(x)
        partial = self.matmul(x, None)
        if self.lora is not None:  # this rank's input columns of A: a partial low-rank product, summed below
            partial = self.lora(x, partial)
        out = self.group.all_reduce(partial)
        return out if self.bias is None else out + self.bias
