"""The low-rank products of one step's adapters, as Punica and S-LoRA compute them.

The base linear runs once over every row of the step, whatever adapter each row uses; then
every row gets its adapter's y += (x @ A^T) @ B^T, the scaling folded into B at load
(layers.fit_adapter). Base rows get nothing added, and a step with no adapter rows leaves every
linear exactly as it was.

Two ways to compute it, the same sums:
- padded (most steps): the rows of every adapter laid side by side in one [adapters, m, in]
  batch (each adapter's rows padded with zero rows to the largest count m), the adapters' A and
  B stacked, so each linear takes a gather, two batched products and a scatter-add whatever
  the number of adapters. Per adapter a gather, two products and a scatter made 64 decode rows
  over 4 adapters cost more than the base linear itself (0.53 against 0.47 ms for q/k/v,
  float32, 2 threads); padded, 0.13 ms.
- segmented (steps whose adapters' row counts differ so much that padding would add more
  than a quarter of their rows, and more than PAD_FREE_ROWS; and --batch-invariant, whose sums must not depend on which other
  adapters share the step): each adapter's rows gathered (a slice where contiguous), its two
  products, a scatter-add.

Which rows use which adapter is worked out once per step (LoraBatch, built with the other step
inputs in shard/step_inputs.py) and read by every adapted linear through one LoraContext the
model shares with them; the model sets it for the duration of a forward (LlamaForCausalLM.forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


# Padding rows a step's padded products may compute beyond the adapters' own: a quarter of
# those, and at least this many (a decode step's groups are small and uneven).
PAD_FREE_ROWS = 64


@dataclass
class PaddedRows:
    """Some groups' rows laid out for one batched product: group j's at slots j*m .. j*m+m-1,
    the rest of each group's slots padding."""

    index: torch.Tensor  # int64 [groups * m]: each slot's row (padding slots: the group's first row)
    pad: torch.Tensor | None  # int64: the padding slots (zeroed before the products), None: none
    m: int


@dataclass
class LoraBatch:
    groups: list[LoraGroup]
    padded: dict = field(default_factory=dict)  # group indices -> PaddedRows or None, once a step

    def padded_rows(self, members: tuple[int, ...]) -> PaddedRows | None:
        """The rows of groups `members` laid out for the padded products, or None where the
        padding would cost more than PAD_FREE_ROWS allows (the segmented products then)."""
        if members in self.padded:
            return self.padded[members]
        counts = [len(self.groups[j].rows) for j in members]
        m, covered = max(counts), sum(counts)
        laid = None
        if len(members) * m <= covered + max(covered // 4, PAD_FREE_ROWS):
            rows = [self.groups[j].rows for j in members]
            index = torch.stack([torch.cat([r, r[:1].expand(m - len(r))]) for r in rows]).reshape(-1)
            pad = [j * m + k for j, n in enumerate(counts) for k in range(n, m)]
            laid = PaddedRows(index, torch.tensor(pad, dtype=torch.int64, device=index.device) if pad else None, m)
        self.padded[members] = laid
        return laid


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
    # The padded products' weights for the last step's adapters (the resident adapters
    # themselves the key, so that one evicted and loaded again is stacked again): the groups
    # that adapt this linear, A^T [n, in, R] and B^T [n, R, out] stacked (ranks padded with
    # zeros to the largest); rebuilt only when the set of adapters in a step changes.
    _stack_key: tuple[LoadedAdapter, ...] | None = field(default=None, repr=False)
    _stack: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        return self.ctx.batch is not None

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        batch = self.ctx.batch
        if batch is None:
            return out
        if self.invariant is None and self._padded(batch, x, out):
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

    def _padded(self, batch: LoraBatch, x: torch.Tensor, out: torch.Tensor) -> bool:
        """The padded products added to out; False where the step's rows do not suit them."""
        key = tuple(g.adapter for g in batch.groups)
        if self._stack_key is None or len(key) != len(self._stack_key) \
                or any(a is not b for a, b in zip(key, self._stack_key)):  # fmt: skip
            parts = [(j, g.adapter.modules[self.name]) for j, g in enumerate(batch.groups)
                     if self.name in g.adapter.modules]  # fmt: skip
            self._stack = None
            if parts:
                r = max(w.a.shape[0] for _, w in parts)
                a = torch.stack([F.pad(w.a, (0, 0, 0, r - w.a.shape[0])).T for _, w in parts]).contiguous()
                b = torch.stack([F.pad(w.b, (0, r - w.b.shape[1])).T for _, w in parts]).contiguous()
                self._stack = (tuple(j for j, _ in parts), a, b)
            self._stack_key = key
        if self._stack is None:  # no adapter of the step adapts this linear
            return True
        members, a, b = self._stack
        rows = batch.padded_rows(members)
        if rows is None:
            return False
        xs = x.index_select(0, rows.index)
        if xs.dtype != a.dtype:  # int8 and GGUF linears may take float32 rows of a bf16 model
            xs = xs.to(a.dtype)
        if rows.pad is not None:
            xs.index_fill_(0, rows.pad, 0)  # padding adds exact zeros to the row it repeats
        delta = torch.bmm(torch.bmm(xs.view(len(members), rows.m, -1), a), b)
        out.index_add_(0, rows.index, delta.view(-1, delta.shape[-1]).to(out.dtype))
        return True

    def _product(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.invariant is not None:
            # Each row summed in one order whatever the group's size, as the base linears.
            return self.invariant.linear(x, w, None)
        return F.linear(x, w)

    def hook(self, module, args, out):
        """As a forward hook on linears that are not PackedLinear (int8, GGUF blocks)."""
        return self(args[0], out)
