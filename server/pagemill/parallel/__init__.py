"""Tensor parallelism: the process group, how weights and heads are split, and the
parallel layers (column/row-parallel linears, vocab-parallel embedding and LM head).
See docs/parallelism.md."""

from pagemill.parallel.group import ParallelConfig, ParallelGroup
from pagemill.parallel.partition import HeadShard, Range, TPLayout, head_shard, split

__all__ = ["HeadShard", "ParallelConfig", "ParallelGroup", "Range", "TPLayout", "head_shard", "split"]
