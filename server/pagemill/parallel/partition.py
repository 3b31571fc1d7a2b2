"""Which slice of every weight a rank holds.

Attention heads are split by KV group: a rank owns whole groups (one KV head
and the query heads that read it), so its attention is ordinary GQA over its
own heads and needs no communication until o_proj. Head counts need not
divide the world size: ranks take contiguous, possibly uneven runs (SmolLM2,
9 query / 3 KV heads on 2 ranks: rank 0 has KV heads 0-1 with query heads 0-5,
rank 1 KV head 2 with query heads 6-8). Uneven splits only cost balance;
they keep the arithmetic of each head exactly that of the unsharded model,
where padding heads would waste compute and replicating all KV heads would
waste KV memory.

With fewer KV heads than ranks, each KV head is replicated on the ranks that
share its query heads (each rank still holds exactly one KV head); the KV
pool then stores that head once per such rank, which is what makes each
rank's attention local.

The MLP intermediate dimension is split the same uneven-contiguous way. The
vocabulary is split into equal slices of ceil(V / world) rows, the last one
padded, because the LM head's all-gather needs equal-sized pieces.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


def split(n: int, parts: int, index: int) -> Range:
    """Part `index` of n items cut into `parts` contiguous runs; the first n % parts get one more."""
    base, extra = divmod(n, parts)
    return Range(index * base + min(index, extra), base + (index < extra))


@dataclass(frozen=True)
class HeadShard:
    q: Range  # query heads this rank computes (global head indices)
    kv: Range  # KV heads it holds


def head_shard(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    if world_size > num_heads:
        raise ValueError(
            f"cannot split {num_heads} attention heads over {world_size} shards: each shard needs at least one"
        )
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv = split(num_kv_heads, world_size, rank)
        return HeadShard(Range(kv.start * group, kv.size * group), kv)
    # Fewer KV heads than ranks: KV head j is served by the ranks of split(world, kv, j),
    # which share its `group` query heads between them.
    for j in range(num_kv_heads):
        ranks = split(world_size, num_kv_heads, j)
        if ranks.start <= rank < ranks.end:
            if group < ranks.size:
                raise ValueError(
                    f"cannot split {num_heads} heads / {num_kv_heads} KV heads over {world_size} shards: "
                    f"KV head {j} has {group} query heads for {ranks.size} shards"
                )
            q = split(group, ranks.size, rank - ranks.start)
            return HeadShard(Range(j * group + q.start, q.size), Range(j, 1))
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class TPLayout:
    """Everything rank `rank` of `world_size` needs to size and load its weights."""

    rank: int
    world_size: int
    heads: HeadShard
    intermediate: Range
    vocab: Range  # rows of the padded vocabulary this rank holds (size equal on all ranks)
    vocab_size: int  # the real vocabulary: rows at or past it are padding

    @classmethod
    def build(cls, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
              world_size: int = 1, rank: int = 0) -> "TPLayout":  # fmt: skip
        if intermediate_size < world_size:
            raise ValueError(f"intermediate_size {intermediate_size} < {world_size} shards")
        per = -(-vocab_size // world_size)
        return cls(
            rank=rank,
            world_size=world_size,
            heads=head_shard(num_heads, num_kv_heads, world_size, rank),
            intermediate=split(intermediate_size, world_size, rank),
            vocab=Range(rank * per, per),
            vocab_size=vocab_size,
        )

    @property
    def vocab_real(self) -> Range:
        """The rows of `vocab` that are real tokens (possibly empty on the last ranks)."""
        end = min(self.vocab.end, self.vocab_size)
        return Range(self.vocab.start, max(0, end - self.vocab.start))
