"""Reference paged attention in plain torch (any device, any dtype).

Clarity over speed: prefill loops over sequences (varlen, no padding) and
gathers a sequence's keys through its block table only when part of it was
cached before this step; decode gathers every sequence's blocks at once and
masks positions past context_lens. GQA maps query head h to kv head
h // (heads // kv_heads), as HF's repeat_kv does: prefill through SDPA's
enable_gqa, decode by folding each kv head's query heads into query rows.

Given the compiled CPU kernels (`--cpu-kernels`, the default; see
cpu_kernels/csrc/decode/decode.cpp, prefill_attention.h), float32 and bfloat16 decode and prefill on
the CPU read the paged cache in place instead of gathering it; `TorchAttentionBackend()` alone is the pure
torch reference the tests compare against.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from pagemill.attention.kv_dtype import KV_SCALE, is_int8, widen, write_rows
from pagemill.cpu_kernels.decode import DecodeKernels, FP8_CACHE
from pagemill.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, kernels: DecodeKernels | None = None) -> None:
        self.kernels = kernels

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if self.kernels is not None and self.kernels.write_kv_applies(k, v, k_cache, v_cache, slot_mapping):
            # A pool in k's dtype: both row copies in one compiled call (cpu_kernels/csrc/attention/kv_write.cpp).
            self.kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)
            return
        # [num_blocks, block_size, kv_heads, pitch] viewed as one row per slot (pitch: head_dim, + 4
        # in an int8 cache: kv_dtype.row_width).
        # An fp8 cache gets a saturating cast, an int8 one rows with their scales; reads below
        # widen them back (kv_dtype.py).
        kv_heads, pitch = k_cache.shape[-2:]
        write_rows(k_cache.view(-1, kv_heads, pitch), slot_mapping, k)
        write_rows(v_cache.view(-1, kv_heads, pitch), slot_mapping, v)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        """window: each query sees only the last `window` keys, itself included (a sliding-window
        layer). softcap: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2)."""
        # (Not over fp8 pools: there the new tokens attend to their exact k/v, as below; not with
        # a soft cap, which the kernels do not apply.)
        usable = self.kernels is not None and softcap is None and _kernel_applies(q, k_cache, v_cache, meta)
        if usable and k_cache.dtype == q.dtype and meta.cu_seqlens_q.dtype == torch.int32 \
                and meta.cu_seqlens_q.is_contiguous():
            # A pool of q's dtype: each sequence's chunk in tiles of tokens x the query heads of a
            # kv head, each reading the keys once (cpu_kernels/csrc/attention/prefill_attention.h).
            return self._kernel_chunks(q, k_cache, v_cache, meta, scale, window)
        # Over int8 pools the decode kernel dequantizes as it reads, so chunks over cached blocks
        # never widen the whole prefix.
        if usable and is_int8(k_cache.dtype) and meta.max_seqlen_q <= KERNEL_PREFILL_MAX_ROWS:
            # Every new token as a one-token query over its sequence's cache up to
            # itself (written above): one compiled call for the whole step.
            tables, lens = _token_rows(meta)
            return self.kernels.paged_attention(q, k_cache, v_cache, tables, lens, scale, window)
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        # A mixed step: the one-token rows (decode tokens next to prompt
        # chunks) attend as one batched decode instead of one SDPA call each,
        # which at 64 running sequences would cost more than the chunk itself.
        singles = _single_rows(meta)
        if singles is not None:
            rows, decode_meta = singles
            decoded = self.decode(q.index_select(0, rows), k_cache, v_cache, decode_meta, scale, window, softcap)
            out.index_copy_(0, rows, decoded)
        start = 0
        for i, (n, total) in enumerate(zip(meta.query_lens, meta.kv_lens)):
            end = start + n
            cached = total - n
            if singles is not None and n == 1:
                pass  # done above
            elif cached == 0 and window is None and softcap is None:
                # Nothing before this step: the fresh k/v are the whole sequence.
                out[start:end] = _sdpa(q[start:end], k[start:end], v[start:end], None, scale, causal=True)
            else:
                num_blocks = -(-total // block_size)
                blocks = meta.block_tables[i, :num_blocks].long()
                keys = widen(_gather(k_cache, blocks, total), q.dtype)
                values = widen(_gather(v_cache, blocks, total), q.dtype)
                # New token j sits at absolute position cached + j and sees keys 0..cached + j.
                # (SDPA's is_causal aligns top-left, which is wrong when cached > 0.)
                key_pos = torch.arange(total, device=q.device)
                query_pos = torch.arange(cached, total, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]
                if window is not None:  # as transformers' sliding mask: key > query - window
                    mask &= key_pos[None, :] > query_pos[:, None] - window
                out[start:end] = _attend(q[start:end], keys, values, mask, scale, softcap)
            start = end
        return out

    def _kernel_chunks(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                       window: int | None) -> torch.Tensor:  # fmt: skip
        """A step's prompt chunks through the compiled kernels. The one-token sequences a mixed
        step plans first (the running sequences' decode rows) attend as a decode step's do, which
        is faster for them (docs/cpu.md); models/batched_decode.py's layer splits them the same
        way, so the two paths stay equal bit for bit."""
        singles = leading_singles(meta.query_lens)
        if singles == 0:
            return self.kernels.prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                                  meta.context_lens, scale, window)  # fmt: skip
        decoded = self.kernels.paged_attention(q[:singles], k_cache, v_cache, meta.block_tables[:singles],
                                               meta.context_lens[:singles], scale, window)  # fmt: skip
        if singles == len(meta.query_lens):
            return decoded
        cu = meta.cu_seqlens_q[singles:] - singles  # int32 (checked by the caller), rows from 0
        chunks = self.kernels.prefill_attention(q[singles:], k_cache, v_cache, meta.block_tables[singles:], cu,
                                                meta.context_lens[singles:], scale, window)  # fmt: skip
        return torch.cat((decoded, chunks))

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        """window, softcap: as prefill."""
        if self.kernels is not None and softcap is None and _kernel_applies(q, k_cache, v_cache, meta):
            return self.kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                                window)  # fmt: skip
        batch, width = meta.block_tables.shape
        block_size, kv_heads, pitch = k_cache.shape[1:]  # pitch: head_dim, or int8's row with its scale
        head_dim = q.shape[2]
        tables, mask, length = _decode_indices(meta, block_size, window)
        # [B, W, block_size, kvh, D] -> [B, kvh, length, D]. The gather copies
        # only the blocks in the (padded) tables, once per layer.
        shape = (batch, width * block_size, kv_heads, pitch)
        keys = widen(_rows(k_cache, tables).view(shape)[:, :length].transpose(1, 2), q.dtype)
        values = widen(_rows(v_cache, tables).view(shape)[:, :length].transpose(1, 2), q.dtype)
        # GQA without expanding K/V: the heads // kv_heads query heads that
        # share a kv head (h -> h // group, as HF's repeat_kv) become that kv
        # head's "query rows". One token each, so the same mask row holds for
        # all of them. Faster on CPU than SDPA's enable_gqa (measured 1.2-1.6x).
        group = q.shape[1] // kv_heads
        q = q.view(batch, kv_heads, group, head_dim)
        if softcap is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        else:
            out = _softcapped(q, keys, values, mask, scale, softcap)
        return out.reshape(batch, kv_heads * group, head_dim)


# Over an int8 pool, prompt chunks up to this many tokens attend through the compiled
# decode kernel, one query row per token; longer ones keep SDPA, whose blocked GEMMs reuse
# each key across many queries (measured: benchmarks/decode_kernels.py, docs/cpu.md).
KERNEL_PREFILL_MAX_ROWS = 1024


def leading_singles(query_lens) -> int:
    """How many of a step's sequences, from the first, have one new token each."""
    n = 0
    while n < len(query_lens) and query_lens[n] == 1:
        n += 1
    return n


def _single_rows(meta: AttentionMetadata):
    """(packed row of each one-token sequence, their decode metadata), or None
    when fewer than two sequences have one token; built once per forward."""
    if "singles" in meta.derived:
        return meta.derived["singles"]
    seqs = [i for i, n in enumerate(meta.query_lens) if n == 1]
    result = None
    if len(seqs) >= 2:
        device = meta.block_tables.device
        index = torch.tensor(seqs, dtype=torch.int64, device=device)
        rows = meta.cu_seqlens_q[:-1].index_select(0, index).long()
        kv_lens = [meta.kv_lens[i] for i in seqs]
        result = rows, AttentionMetadata(
            is_prefill=False,
            slot_mapping=meta.slot_mapping[:0],
            cu_seqlens_q=torch.arange(len(seqs) + 1, dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor([0, *itertools.accumulate(kv_lens)], dtype=torch.int32, device=device),
            max_seqlen_q=1,
            max_seqlen_k=max(kv_lens),
            # Padded as wide as the step's widest table; context_lens bound the reads.
            block_tables=meta.block_tables.index_select(0, index),
            context_lens=meta.context_lens.index_select(0, index),
            query_lens=[1] * len(seqs),
            kv_lens=kv_lens,
        )
    meta.derived["singles"] = result
    return result


def _token_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per new token: its sequence's block table and its causal context length
    (cached + 1 + its index among the sequence's new tokens); built once per forward."""
    if "token_rows" not in meta.derived:
        device = meta.block_tables.device
        seq = torch.repeat_interleave(torch.arange(len(meta.query_lens), device=device),
                                      torch.tensor(meta.query_lens, device=device))  # fmt: skip
        first = torch.tensor([total - n + 1 for n, total in zip(meta.query_lens, meta.kv_lens)], device=device)
        offset = torch.arange(len(seq), device=device) - meta.cu_seqlens_q[:-1].long()[seq]
        lens = (first[seq] + offset).to(torch.int32)
        meta.derived["token_rows"] = meta.block_tables.index_select(0, seq).contiguous(), lens
    return meta.derived["token_rows"]


def _kernel_applies(q, k_cache, v_cache, meta: AttentionMetadata) -> bool:
    return (
        q.device.type == "cpu"
        and k_cache.dtype == v_cache.dtype
        and (q.dtype == k_cache.dtype or is_int8(k_cache.dtype) or (k_cache.dtype in FP8_CACHE and KV_SCALE == 1.0))
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.stride(2) == 1
        and q.stride(1) == q.shape[2]
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and meta.block_tables.is_contiguous()
        and meta.block_tables.dtype == meta.context_lens.dtype == torch.int32
    )


def _decode_indices(meta: AttentionMetadata, block_size: int, window: int | None):
    """(int64 block tables, attention mask or None, keys kept), built once per forward and window."""
    cached = meta.derived.get(("decode", window))
    if cached is not None:
        return cached
    batch, width = meta.block_tables.shape
    tables, length = meta.block_tables.long(), width * block_size
    if window is not None and (meta.static or max(meta.kv_lens) > window):
        # A query at position n - 1 sees keys n - window .. n - 1 (transformers: key > query - window).
        positions = torch.arange(width * block_size, device=tables.device)
        lens = meta.context_lens[:, None].long()
        mask = ((positions[None, :] < lens) & (positions[None, :] >= lens - window))[:, None, None, :]
    elif not meta.static and (batch == 1 or all(n == length for n in meta.kv_lens)):
        # One sequence: keep exactly its keys; or every table is full. No mask
        # lets SDPA take its unmasked path.
        length, mask = max(meta.kv_lens), None
    else:
        positions = torch.arange(width * block_size, device=tables.device)
        # Padding blocks (id 0) and the tail of the last block are masked out.
        mask = (positions[None, :] < meta.context_lens[:, None].long())[:, None, None, :]
    meta.derived[("decode", window)] = tables, mask, length
    return tables, mask, length


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` entries of a sequence, [length, kv_heads, head_dim]."""
    return _rows(cache, blocks).flatten(0, 1)[:length]


def _rows(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] for int64 block ids of any shape: [*blocks.shape, block_size, kvh, D].

    index_select on the flattened ids, not advanced indexing: the same copy,
    2-4x faster on CPU (measured for 64 x 17 blocks of 16 x 3 x 64 floats).
    """
    return cache.index_select(0, blocks.reshape(-1)).view(*blocks.shape, *cache.shape[1:])


def _attend(q, k, v, mask, scale: float, softcap: float | None) -> torch.Tensor:
    """q [n, H, D], k/v [L, kvh, D], mask [n, L] -> [n, H, D]."""
    if softcap is None:
        return _sdpa(q, k, v, mask, scale, causal=False)
    group = q.shape[1] // k.shape[1]
    # [kvh, group * n, D] against [kvh, L, D]: the query heads sharing a kv head as its rows.
    n, heads, d = q.shape
    rows = q.view(n, k.shape[1], group, d).permute(1, 2, 0, 3)  # [kvh, group, n, D]
    keys, values = k.transpose(0, 1).unsqueeze(1), v.transpose(0, 1).unsqueeze(1)  # [kvh, 1, L, D]
    out = _softcapped(rows, keys, values, mask, scale, softcap)  # [kvh, group, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, heads, d)


def _softcapped(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """softmax(softcap * tanh(q k^T * scale / softcap) + mask) v, as Gemma 2's eager attention.
    q [..., n, D], k/v [..., L, D] (leading dims broadcast), mask (True: visible) to [..., n, L]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


def _sdpa(q, k, v, mask, scale: float, causal: bool) -> torch.Tensor:
    """q [n, H, D], k/v [L, kvh, D] -> [n, H, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)
