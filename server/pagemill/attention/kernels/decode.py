"""Paged decode: one new token per sequence, split-K over long contexts (flash-decoding).

A program owns one sequence, one kv head and one partition of its context.
All GROUP query heads of that kv head ride in one [BLOCK_G, head_dim] tile,
so each K/V tile is read from HBM once per group instead of once per query
head (decode is bandwidth-bound; that read is the whole cost).

A batch too small to fill the GPU with (sequence, kv head) programs leaves
most SMs idle while a few walk long contexts. Splitting each context into
partitions multiplies the programs; each writes its normalised partial
output and log-sum-exp in fp32, and a reduce kernel combines the partitions
of a head with weights exp(lse_s - max lse).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagemill.attention.kernels.common import check_cache, dot_precision, head_block, soft_cap, window_arg

BLOCK_N = 64  # keys per inner step: a 64 x 128 bf16 K tile is 16 KiB
MIN_PARTITION = 256  # shorter partitions cost more in partial writes + reduce than they gain
MAX_SPLITS = 64  # bounds the reduce kernel's tile of partitions
PROGRAMS_PER_SM = 2  # enough resident programs per SM to overlap one's loads with another's math


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, block_tables_ptr, context_lens_ptr,
    scale, window, stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt, num_heads, max_splits, partition_size,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    if start >= kv_len:  # shorter than the batch's longest: the reduce skips this partition
        return
    end = tl.minimum(start + partition_size, kv_len)

    # tl.dot needs >= 16 rows: groups smaller than BLOCK_G are padded, masked rows.
    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    # A sliding window hides keys before kv_len - window. A partition wholly
    # before it writes out 0 and lse -inf (l_i stays 0), which the reduce weighs 0.
    for tile_start in range(tl.maximum(start, kv_len - window), end, BLOCK_N):
        cols = tile_start + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        block = tl.load(table + cols // BLOCK_SIZE, mask=col_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (cols % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)

        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        qk = soft_cap(qk, SOFTCAP) * 1.4426950408889634  # log2(e): the softmax runs on exp2
        qk = tl.where(col_ok[None, :], qk, float("-inf"))
        # The partition's first tile has a visible key in every row: m_i is finite after it.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part = (seq * num_heads + heads) * max_splits + split  # [B, heads, max_splits] row
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=g_ok)  # base-2 log-sum-exp
    else:
        dst = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, context_lens_ptr,
    stride_ob, stride_oh, num_heads, max_splits, partition_size,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    seq = tl.program_id(1)
    splits = tl.cdiv(tl.load(context_lens_ptr + seq), partition_size)  # partitions the decode kernel wrote
    s = tl.arange(0, BLOCK_S)
    s_ok = s < splits
    d = tl.arange(0, BLOCK_D)
    part = (seq * num_heads + head) * max_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # unwritten partitions get exp2(-inf) = 0
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & (d < HEAD_DIM)[None, :],
                other=0.0)  # fmt: skip
    out = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_partition_size(batch: int, kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Tokens per split-K partition; >= max_kv_len means no split.

    Splits only as far as needed to give every SM PROGRAMS_PER_SM programs,
    never into partitions under MIN_PARTITION tokens, at most MAX_SPLITS.
    Partitions are whole BLOCK_N tiles so only the context's last tile is ragged.
    """
    programs = batch * kv_heads
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
    splits = max(1, min(wanted, max_kv_len // MIN_PARTITION, MAX_SPLITS))
    return triton.cdiv(triton.cdiv(max(max_kv_len, 1), splits), BLOCK_N) * BLOCK_N


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_kv_len: int,
    scale: float,
    partition_size: int,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, heads, head_dim], one token per sequence, against its first context_lens[i] keys
    (the last `window` of them for a sliding-window layer); softcap: as paged_prefill."""
    check_cache(k_cache, v_cache)
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last dimension")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = heads // kv_heads
    splits = triton.cdiv(max_kv_len, partition_size)
    split = splits > 1
    part_out = torch.empty((batch, heads, splits, head_dim) if split else (0,), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, heads, splits) if split else (0,), dtype=torch.float32, device=q.device)
    _decode_kernel[(kv_heads, batch, splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, context_lens,
        scale, window_arg(window), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), heads, splits, partition_size,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_N=BLOCK_N, BLOCK_D=head_block(head_dim), SPLIT=split, PRECISION=dot_precision(q.dtype),
        SOFTCAP=float(softcap or 0.0), num_warps=4, num_stages=2,
    )  # fmt: skip
    if split:
        _reduce_kernel[(heads, batch)](
            part_out, part_lse, out, context_lens, out.stride(0), out.stride(1), heads, splits, partition_size,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=head_block(head_dim),
        )  # fmt: skip
    return out
