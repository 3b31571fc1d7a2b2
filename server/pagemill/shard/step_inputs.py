"""Packing one step's computed entries into the model's inputs.

Per entry the fed tokens are token_ids[start:end] plus its speculative
proposals, at positions start.. ; each position's slot follows from the
block table: block_table[p // block_size] * block_size + p % block_size.
A step that feeds exactly one token per entry is a decode step (decode
metadata: fused CPU layer, CUDA graphs); anything else is one varlen
prefill-style forward over all entries. Which rows use which LoRA adapter is
worked out here too, once for every adapted linear of the forward
(lora/apply.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pagemill.attention.metadata import AttentionMetadata, make_metadata
from pagemill.lora.apply import LoraBatch, build_batch
from pagemill.shard.requests import Entry


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    last_rows: torch.Tensor  # [B] row of each entry's last fed token in the packed axis
    lora: LoraBatch | None = None  # rows per adapter (None: every row runs the base model alone)


def slot(table: Sequence[int], pos: int, block_size: int) -> int:
    return table[pos // block_size] * block_size + pos % block_size


def fed_tokens(e: Entry) -> list[int]:
    return e.state.token_ids[e.start : e.end] + e.proposals


def is_decode_step(entries: Sequence[Entry]) -> bool:
    return all(e.num_tokens == 1 and not e.proposals for e in entries)


def build_inputs(entries: Sequence[Entry], block_size: int, device) -> StepInputs:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_rows: list[int] = []
    query_lens: list[int] = []
    decode = True
    for e in entries:
        fed = fed_tokens(e)
        table, n = e.state.block_table, len(fed)
        ids += fed
        positions += range(e.start, e.start + n)
        slots += [slot(table, p, block_size) for p in range(e.start, e.start + n)]
        last_rows.append(len(ids) - 1)
        query_lens.append(n)
        decode = decode and e.num_tokens == 1 and not e.proposals
    # One int64 tensor, cut into views: a tensor per field cost ~8 us each.
    t, b = len(ids), len(entries)
    packed = torch.tensor(ids + positions + last_rows + slots, dtype=torch.int64, device=device)
    meta = make_metadata(
        is_prefill=not decode,
        query_lens=query_lens,
        kv_lens=[e.start + q for e, q in zip(entries, query_lens)],
        block_tables=[e.state.block_table for e in entries],
        slot_mapping=packed[2 * t + b :],
        device=device,
    )
    lora = build_batch([e.state.adapter for e in entries], query_lens, device)
    return StepInputs(packed[:t], packed[t : 2 * t], meta, packed[2 * t : 2 * t + b], lora)
