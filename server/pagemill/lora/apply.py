"""The segmented low-rank product of one step, as Punica and S-LoRA compute it.

The base linear runs once over every row of the step, whatever adapter each row uses; then,
for each adapter present, its rows are gathered and get y[rows] += (x[rows] @ A^T) @ B^T, the
scaling folded into B at load (layers.fit_adapter). Base rows cost nothing beyond the base
product, and a step with no adapter rows leaves every linear exactly as it was.

Which rows use which adapter is worked out once per step (LoraBatch, built with the other step
inputs in shard/step_inputs.py) and read by every adapted linear through one LoraContext the
model shares with them; the model sets it for the duration of a forward (LlamaForCausalLM.forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pagemill.models.batch_invariant import Invariant


@dataclass
class ModuleWeights:
    """One adapter on one of our linears (fused q/k/v or gate/up included), this rank's slice."""

    a: torch.Tensor  # [R, in]: the A of every part stacked (R = rank x parts)
    b: torch.Tensor  # [out, R]: block-diagonal over the parts, zero where a part is absent; scaling folded in


@dataclass
class LoadedAdapter:
    """An adapter fitted to this rank's model, resident in the pool."""

    id: int
    name: str
    path: str
    rank: int
    modules: dict[str, ModuleWeights]  # our module path (model.layers.0.self_attn.qkv_proj) -> weights
    nbytes: int


@dataclass
class LoraGroup:
    """The rows of one step that use one adapter."""

    adapter: LoadedAdapter
    rows: torch.Tensor  # int64 [n] rows of the packed token axis
    span: tuple[int, int] | None  # (start, end) when those rows are contiguous: a slice, no gather


@dataclass
class LoraBatch:
    groups: list[LoraGroup]


def build_batch(adapters: Sequence[LoadedAdapter | None], counts: Sequence[int], device) -> LoraBatch | None:
    """adapters[i]: entry i's adapter (None: the base), counts[i]: the rows it feeds, entries
    packed in order -> the step's row groups, or None when no row uses an adapter."""
    if all(a is None for a in adapters):
        return None
    rows: dict[int, tuple[LoadedAdapter, list[int]]] = {}
    start = 0
    for a, n in zip(adapters, counts, strict=True):
        if a is not None:
            rows.setdefault(a.id, (a, []))[1].extend(range(start, start + n))
        start += n
    groups = []
    for a, r in rows.values():
        contiguous = r[-1] - r[0] + 1 == len(r)
        groups.append(LoraGroup(a, torch.tensor(r, dtype=torch.int64, device=device),
                                (r[0], r[-1] + 1) if contiguous else None))  # fmt: skip
    return LoraBatch(groups)


@dataclass
class LoraContext:
    """What the adapted linears of one model read: the current step's row groups (None: none)."""

    batch: LoraBatch | None = None


@dataclass
class LoraLayer:
    """The adapter side of one linear: `out = layer(x, out)` after the base product (before a
    row-parallel all-reduce: the partial low-rank product adds into the partial base output)."""

    name: str  # our module path, the key of LoadedAdapter.modules
    in_features: int
    out_features: int
    parts: int  # HF projections fused into this linear (q/k/v: 3, gate/up: 2, else 1)
    ctx: LoraContext
    invariant: Invariant | None = None  # --batch-invariant: both products as the base linears run theirs

    @property
    def active(self) -> bool:
        return self.ctx.batch is not None

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        batch = self.ctx.batch
        if batch is None:
            return out
        for g in batch.groups:
            w = g.adapter.modules.get(self.name)
            if w is None:  # the adapter leaves this linear alone
                continue
            xs = x[g.span[0] : g.span[1]] if g.span is not None else x.index_select(0, g.rows)
            if xs.dtype != w.a.dtype:  # int8 and GGUF linears may take float32 rows of a bf16 model
                xs = xs.to(w.a.dtype)
            delta = self._product(self._product(xs, w.a), w.b).to(out.dtype)
            if g.span is not None:
                out[g.span[0] : g.span[1]] += delta
            else:
                out.index_add_(0, g.rows, delta)
        return out

    def _product(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.invariant is not None:
            # Each row summed in one order whatever the group's size, as the base linears.
            return self.invariant.linear(x, w, None)
        return F.linear(x, w)

    def hook(self, module, args, out):
        """As a forward hook on linears that are not PackedLinear (int8, GGUF blocks)."""
        return self(args[0], out)
