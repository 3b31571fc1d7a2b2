"""Varlen causal prefill over the paged KV pool (FlashAttention-2 style online softmax).

A program owns BLOCK_M consecutive new tokens of one sequence for one query
head and streams that sequence's keys/values through its block table in
BLOCK_N-token tiles, keeping the running max m, the running sum l and the
unnormalised output in fp32 registers, so the [n, L] score matrix never
exists. New token j of a sequence with `cached` prefix tokens sits at
position cached + j and sees keys 0..cached + j, so a cached prefix is the
same loop with a shifted diagonal. The kernel runs after write_kv and reads
the fresh keys from the pool too: one code path for fresh and cached prompts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagemill.attention.kernels.common import check_cache, dot_precision, head_block, soft_cap, window_arg


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    scale, window, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    # Heads vary fastest in launch order, so the GROUP query heads sharing a
    # kv head run side by side and read the same K/V tiles from L2.
    head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:  # the grid is sized for the longest sequence
        return
    kv_len = tl.load(context_lens_ptr + seq)
    cached = kv_len - q_len
    kv_head = head // GROUP  # GQA: no repeated K/V, just the shared head's rows

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_ok = rows < q_len
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    q_pos = cached + rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    # Keys after the tile's last query are masked for every row: stop there;
    # keys before the first query's window are masked for every row: start there.
    hi = tl.minimum(kv_len, cached + (tile + 1) * BLOCK_M)
    lo = tl.maximum(cached + tile * BLOCK_M - window + 1, 0)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        # A tile may straddle pool blocks: each key finds its own block.
        block = tl.load(table + cols // BLOCK_SIZE, mask=col_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (cols % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)

        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        qk = soft_cap(qk, SOFTCAP) * 1.4426950408889634  # log2(e): the softmax runs on exp2
        visible = (cols[None, :] <= q_pos[:, None]) & (cols[None, :] > q_pos[:, None] - window) & col_ok[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        # A sliding window can leave a row nothing visible in a tile so far:
        # subtract 0 instead of -inf there (exp2(-inf - -inf) would be nan).
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        # P goes back to the input type for the tensor-core PV product, as in
        # FlashAttention-2; the accumulator stays fp32.
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # 0: a padding row a window left nothing
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )  # fmt: skip


def prefill_tiles(max_seqlen_q: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for a prefill.

    64x64 fp32 score tiles keep a 4-warp program within registers up to
    head_dim 128 while giving tl.dot full tensor-core shapes; wider heads
    halve BLOCK_N to keep K/V tiles (2 x BLOCK_N x head_dim) in shared memory.
    Short suffixes after a cached prefix (and speculative verification) would
    waste most of a 64-row tile, so they get 16 rows, tl.dot's minimum.
    """
    block_m = 16 if max_seqlen_q <= 16 else 64
    block_n = 64 if head_dim <= 128 else 32
    return block_m, block_n


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, heads, head_dim] packed by cu_seqlens_q; keys are the first context_lens[i] of each table.
    window: a query sees only its last `window` keys; softcap: Gemma 2's attention-logit capping."""
    check_cache(k_cache, v_cache)
    tokens, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last dimension")
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    block_m, block_n = prefill_tiles(max_seqlen_q, head_dim)
    grid = (heads, triton.cdiv(max_seqlen_q, block_m), block_tables.shape[0])
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens,
        scale, window_arg(window), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=heads // kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=head_block(head_dim), PRECISION=dot_precision(q.dtype),
        SOFTCAP=float(softcap or 0.0), num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
