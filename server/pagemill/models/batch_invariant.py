"""`--batch-invariant`: a request's bits do not depend on what else shares its steps.

A linear's output row is a sum over the input features, and the library GEMMs pick their
blocking, kernels and thread split from the number of rows, so the same row is summed in a
different order at 1 row than at 64. Here every linear runs on the compiled invariant GEMM
(cpu_kernels/invariant.py: each element summed in an order fixed by K alone), or, without the
compiled kernels, on torch's GEMM over tiles of exactly TILE_ROWS rows (the last one padded with
zero rows: one shape per weight, whatever the batch, at 16 rows' cost for one). The per-op path
everywhere else (no compiled fused or batched decode layers, whose use depends on the batch
size), and attention through attention/invariant_backend.py. Norms, rotary and activations are
per row already.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagemill.cpu_kernels.invariant import InvariantKernels

TILE_ROWS = 16


@dataclass(frozen=True)
class Invariant:
    """How this model's linears run: the compiled kernels, or None for torch's tiles."""

    kernels: InvariantKernels | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernels is not None and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu":
            return self.kernels.linear(x, weight, bias)
        return invariant_linear(x, weight, bias)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias), each row through a [TILE_ROWS, K] product."""
    rows = x.shape[0]
    pad = -rows % TILE_ROWS
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    out = torch.cat([F.linear(x[i : i + TILE_ROWS], weight, bias) for i in range(0, rows + pad, TILE_ROWS)])
    return out[:rows]


class InvariantLinear(nn.Linear):
    """A plain nn.Linear (an MoE router's gate) on invariant_linear, sharing its parameters."""

    invariant: Invariant

    @classmethod
    def of(cls, linear: nn.Linear, invariant: Invariant) -> "InvariantLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.invariant = invariant
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.invariant.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias).view(*x.shape[:-1], -1)
        return self.invariant.linear(x, self.weight, self.bias)


def make_batch_invariant(model: nn.Module, invariant: Invariant) -> int:
    """Every linear of `model` switched to `invariant` (PackedLinears by their attribute, plain
    nn.Linears replaced in place); returns how many. Raises ValueError naming a linear it
    cannot switch (a quantized or other custom linear)."""
    from pagemill.models.packed_linear import PackedLinear

    n = 0
    for name, m in list(model.named_modules()):
        if isinstance(m, PackedLinear):
            m.invariant = invariant
        elif type(m) is nn.Linear:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, InvariantLinear.of(m, invariant))
        elif isinstance(m, nn.Linear) or "Linear" in type(m).__name__:
            raise ValueError(f"--batch-invariant does not cover {name} ({type(m).__name__})")
        else:
            continue
        n += 1
    for holder in (model, getattr(model, "model", None)):
        for attr in ("fused", "batched"):
            if getattr(holder, attr, None) is not None:
                setattr(holder, attr, None)
    return n
