"""What an attention backend needs to know about one packed forward pass.

Tokens of all sequences are packed along one axis (no padding): sequence i
owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of q/k/v. Its keys/values live in
the paged KV pool, reachable through block_tables[i].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 [T]: flat KV slot (block * block_size + offset) of each new token
    cu_seqlens_q: torch.Tensor  # int32 [B+1]: prefix sums of new-token counts
    cu_seqlens_k: torch.Tensor  # int32 [B+1]: prefix sums of total lengths (cached prefix + new)
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: torch.Tensor  # int32 [B, max_blocks], right-padded with block 0 (scratch)
    context_lens: torch.Tensor  # int32 [B]: total KV length of each sequence after this step
    # Host copies of the per-sequence lengths, so that reference code looping
    # over sequences does not synchronise with the device for every .item().
    query_lens: list[int]
    kv_lens: list[int]
    # Tensors a backend derives from the fields above (index dtypes, masks).
    # They are the same in every layer, so a backend builds them in the first
    # layer of a forward and reuses them in the others.
    derived: dict[str, Any] = field(default_factory=dict, repr=False)
    # Static (CUDA-graph) decode: the tensors change between replays, the host
    # fields do not. kv_lens / max_seqlen_k are then only upper bounds (the
    # table width in tokens) and a backend must mask by context_lens on the
    # device and size its grid from the host fields (shard/cuda_graphs.py).
    static: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def make_metadata(
    *,
    is_prefill: bool,
    query_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    slot_mapping: Sequence[int],
    device: torch.device | str,
) -> AttentionMetadata:
    """Builds the tensors from per-sequence python lists.

    query_lens[i] new tokens of sequence i are written at slot_mapping and
    attend to kv_lens[i] keys (the cached prefix plus themselves). slot_mapping may be an
    int64 tensor on `device` already (step_inputs packs it with the token ids).
    """
    assert len(query_lens) == len(kv_lens) == len(block_tables)
    assert len(slot_mapping) == sum(query_lens)
    b = len(query_lens)
    width = max((len(t) for t in block_tables), default=0)
    # Every int32 field is a view of one tensor, made from one list: a tensor per field cost
    # ~8 us each, a sizeable part of a batch-1 decode step's Python (docs/cpu.md).
    flat = _prefix_sums(query_lens) + _prefix_sums(kv_lens) + list(kv_lens)
    for t in block_tables:
        flat += t
        flat += [0] * (width - len(t))
    ints = torch.tensor(flat, dtype=torch.int32, device=device)
    slots = slot_mapping
    if not isinstance(slots, torch.Tensor):
        slots = torch.tensor(list(slots), dtype=torch.int64, device=device)
    return AttentionMetadata(
        is_prefill=is_prefill,
        slot_mapping=slots,
        cu_seqlens_q=ints[: b + 1],
        cu_seqlens_k=ints[b + 1 : 2 * b + 2],
        max_seqlen_q=max(query_lens, default=0),
        max_seqlen_k=max(kv_lens, default=0),
        block_tables=ints[3 * b + 2 :].view(b, width),
        context_lens=ints[2 * b + 2 : 3 * b + 2],
        query_lens=list(query_lens),
        kv_lens=list(kv_lens),
    )


def _prefix_sums(lens: Sequence[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out
