"""Batch-invariant paged attention (`--batch-invariant`): every new token's output depends on
its own sequence's keys and its position only, never on what else shares the step or on how
its prompt was chunked.

The other backends are not: the compiled decode kernel splits a context over threads when
there are few sequences, the torch path pads decode contexts to the step's longest one, and a
prompt chunk's SDPA tiles its queries by the chunk's length. Each of those changes the order in
which a row's sums are taken, so the same request's bits move with the crowd.

Here each new token is one query row at its absolute position p. Its keys are read from the
cache (written before, as in every backend) padded to P, the next multiple of KEY_TILE above p
with padding that is exactly zero and masked, so P, and with it every shape the row goes
through, is a function of p alone. Rows of one P go through the same ops in groups of exactly
ROW_TILE (short groups padded with zero rows), so the products run on one shape whatever the
batch. Decode rows and prompt rows take this same path, so a token computed in a prompt chunk
and the same token decoded are equal too.

With the compiled kernels (cpu_kernels/invariant.py) each (token, head) is one task of
csrc/attention/invariant_attention.cpp instead: scores, softmax and the sum over values taken
in increasing key position over the token's own keys only, so no padding is needed; the torch
path above is what runs without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagemill.attention.kv_dtype import is_int8, widen
from pagemill.attention.metadata import AttentionMetadata
from pagemill.attention.torch_backend import TorchAttentionBackend

if TYPE_CHECKING:
    from pagemill.cpu_kernels.invariant import InvariantKernels

KEY_TILE = 64  # keys a row's context is padded to a multiple of
ROW_TILE = 16  # query rows per call


class BatchInvariantAttention:
    name = "batch-invariant"

    def __init__(self, kernels: InvariantKernels | None = None) -> None:
        self._writer = TorchAttentionBackend()  # the plain torch KV write: per slot, no reductions
        self._kernels = kernels

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._writer.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        return self._rows(q, k_cache, v_cache, meta, scale, window, softcap)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        return self._rows(q, k_cache, v_cache, meta, scale, window, softcap)

    def _rows(self, q, k_cache, v_cache, meta, scale, window, softcap) -> torch.Tensor:
        if is_int8(k_cache.dtype):
            raise ValueError("batch-invariant attention reads float, bf16 or fp8 caches, not int8")
        seq, pos = token_positions(meta)
        if self._kernels is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
            return self._kernels.attention(q, k_cache, v_cache, meta.block_tables, seq, pos, scale, window, softcap)
        out = torch.empty_like(q)
        padded = (pos // KEY_TILE + 1) * KEY_TILE
        for p_len in torch.unique(padded).tolist():
            rows = torch.nonzero(padded == p_len).flatten()
            for start in range(0, len(rows), ROW_TILE):
                part = rows[start : start + ROW_TILE]
                out.index_copy_(0, part, self._tile(q, k_cache, v_cache, meta, part, seq[part], pos[part], p_len,
                                                    scale, window, softcap))  # fmt: skip
        return out

    def _tile(self, q, k_cache, v_cache, meta, part, seq, pos, p_len: int, scale, window, softcap) -> torch.Tensor:
        """Up to ROW_TILE rows of q (`part`; their sequence indices and positions) whose padded
        context is p_len keys."""
        n = len(seq)
        heads, head_dim = q.shape[1], q.shape[2]
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = heads // kv_heads
        pad = ROW_TILE - n
        if pad:  # rows past n: sequence 0 at position 0, computed and dropped
            seq = torch.cat((seq, seq.new_zeros(pad)))
            pos = torch.cat((pos, pos.new_zeros(pad)))
        keys_at = torch.arange(p_len, device=q.device)
        visible = keys_at[None, :] <= pos[:, None]  # [R, P]
        if window is not None:  # as transformers' sliding mask: key > query - window
            visible &= keys_at[None, :] > pos[:, None] - window
        # The flat cache slot of each (row, key); keys past the row's table read block 0 (scratch)
        # and are zeroed below, so what that block holds never reaches an output.
        width = meta.block_tables.shape[1]
        block_idx = (keys_at // block_size).clamp(max=width - 1)
        blocks = meta.block_tables.long()[seq][:, block_idx]  # [R, P]
        slots = (blocks * block_size + keys_at % block_size).reshape(-1)
        flat_k = k_cache.view(-1, kv_heads, k_cache.shape[-1])
        flat_v = v_cache.view(-1, kv_heads, v_cache.shape[-1])
        zero = visible[:, :, None, None]
        keys = torch.where(zero, widen(flat_k.index_select(0, slots), q.dtype).view(ROW_TILE, p_len, kv_heads, -1), 0)
        values = torch.where(zero, widen(flat_v.index_select(0, slots), q.dtype).view(ROW_TILE, p_len, kv_heads, -1),
                             0)  # fmt: skip
        rows = torch.zeros(ROW_TILE, heads, head_dim, dtype=q.dtype, device=q.device)
        rows[:n] = q.index_select(0, part)
        # [R, kvh, group, D] x [R, kvh, D, P]: the query heads sharing a kv head as its rows.
        qh = rows.view(ROW_TILE, kv_heads, group, head_dim)
        scores = torch.matmul(qh, keys.permute(0, 2, 3, 1)).float() * scale  # [R, kvh, group, P]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [R, kvh, group, D]
        return out.reshape(ROW_TILE, heads, head_dim)[:n]


def token_positions(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per new token (in the step's packed order): its sequence's index and its absolute
    position (the cached prefix plus its index among the sequence's new tokens); built once per
    forward."""
    if "invariant_rows" not in meta.derived:
        device = meta.block_tables.device
        seq, pos = [], []
        for i, (n, total) in enumerate(zip(meta.query_lens, meta.kv_lens)):
            seq += [i] * n
            pos += range(total - n, total)
        meta.derived["invariant_rows"] = (torch.tensor(seq, dtype=torch.int64, device=device),
                                          torch.tensor(pos, dtype=torch.int64, device=device))  # fmt: skip
    return meta.derived["invariant_rows"]

