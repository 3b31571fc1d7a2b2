"""Vocab-parallel token embedding and LM head.

Both hold the rows [vocab.start, vocab.end) of the (padded) vocabulary, so a
tied LM head shares the embedding's local weight exactly as the unsharded
model shares the full one.

Embedding: a rank looks up only the ids in its range, writes zeros for the
others, and one all-reduce sums the pieces (exactly one rank contributes
each row, so the sum is exact). LM head: each rank computes the logits of
its vocabulary slice; an all-gather gives every rank the full, identical
logits, so every rank samples the same tokens from the same generators.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.models.packed_linear import PackedLinear
from pagemill.parallel.group import ParallelGroup
from pagemill.parallel.partition import Range


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: Range, hidden_size: int, group: ParallelGroup) -> None:
        super().__init__()
        self.vocab, self.group = vocab, group
        self.weight = nn.Parameter(torch.empty(vocab.size, hidden_size))
        nn.init.normal_(self.weight)  # nn.Embedding's init (a no-op on the meta device the loader uses)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab.start
        mine = (local >= 0) & (local < self.vocab.size)
        rows = F.embedding(torch.where(mine, local, 0), self.weight)
        # where, not a multiply: padding rows are never initialised and 0 * NaN is NaN.
        rows = torch.where(mine[:, None], rows, 0)
        return self.group.all_reduce(rows)


class ParallelLMHead(PackedLinear):
    """hidden [N, H] -> full logits [N, vocab_size] on every rank."""

    def __init__(self, hidden_size: int, vocab: Range, vocab_size: int, group: ParallelGroup) -> None:
        super().__init__(hidden_size, vocab.size, bias=False)
        self.vocab_size, self.group = vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(x, None)
        if self.group.world_size == 1:
            return logits
        logits = self.group.all_gather(logits, dim=-1)
        if logits.shape[-1] != self.vocab_size:  # drop the padding rows' logits
            logits = logits[:, : self.vocab_size].contiguous()
        return logits
