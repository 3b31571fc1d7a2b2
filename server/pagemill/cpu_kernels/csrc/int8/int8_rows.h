// The int8 linear of --quantize int8: y[M, N] = x[M, K] @ w[N, K]^T (+ bias),
// shared by int8_linear.cpp (one linear per call) and decode.cpp (the fused
// layer of int8 models), so both give the same integer sums.
//
// Weights: symmetric int8 per output channel (w ~= w_scale[n] * wq[n, k]),
// quantized once at load (models/quantized_linear.py). Activations:
// symmetric int8 per row (token), quantized here on every call
// (x ~= x_scale[m] * xq[m, k], x_scale = max|x[m]| / 127, round half to
// even). The products are summed exactly in int32, so every path below
// gives the same integers and the torch reference of the same arithmetic
// agrees to the last bit of the accumulators.
//
// Why int8: at a few rows a decode step is a stream over the weights, and
// int8 reads a quarter of float32's bytes (half of bfloat16's). At 64 rows
// it is compute-bound, and one VNNI instruction does 64 multiply-adds where
// a float32 FMA does 16.
//
// AVX512-VNNI's vpdpbusd multiplies UNSIGNED bytes by signed bytes. The
// activations are signed, so they are stored offset by 128 (xu = xq + 128,
// 1..255) and the offset's contribution, 128 * sum_k wq[n, k], is
// subtracted after the sum (w_corr, precomputed at quantize time).
//
// Weight layout (packed at quantize time): N padded to 16 and K to 4, then
// [N/16][K/4][16][4]: for each group of 4 k, the 16 output channels of a
// block sit in one 64-byte vector, 4 consecutive k per 32-bit lane, which is
// what vpdpbusd consumes against a broadcast of 4 activation bytes. A
// micro-tile keeps 4 such blocks (64 outputs) x up to 6 rows in 24
// accumulator registers, so each weight vector loaded is used by 6 rows
// (batch 64 is compute-bound on the vpdpbusd, not on loads) and at one row
// the weights stream from 4 sequential blocks. Threads split the blocks
// evenly; each thread walks all rows for its blocks, so the weights are
// read from memory once per call whatever the row count.
//
// Without AVX512-VNNI + AVX512BW (or when built with them disabled, see
// tests/test_int8_linear.py) a portable loop over the same layout gives the
// same integers. Where the CPU has AMX-INT8, calls of 8+ rows run on its tiles
// (int8_amx.h), again the same integers.
#pragma once
#include <omp.h>
#include <stdint.h>

#include "common/team_balance.h"
#include "int8/int8_amx.h"  // share_amx: the same sums on AMX tiles
#include "int8/int8_tile.h"

namespace pagemill::int8 {

// One thread's share of y = x wq^T: thread t of nt takes a contiguous range
// of blocks (a.balance's share, else an even one; not whole tiles: 9 tiles of
// 4 blocks over 2 threads would leave one idle 1/9 of the time) and walks all
// rows for each, so the weights are read from memory once whatever the row count.
inline void share(const Args& a, int t, int nt) {
  const balance::Busy busy(a.balance, t, nt);
  if (amx_takes(a)) return share_amx(a, t, nt);
  const int64_t blocks = (a.N + kBlock - 1) / kBlock;
  const int64_t first = balance::bound(a.balance, blocks, t, nt), last = balance::bound(a.balance, blocks, t + 1, nt);
  for (int64_t b = first; b < last; b += kTileBlocks) {
    const int nb = (int)(last - b < kTileBlocks ? last - b : kTileBlocks);
    for (int64_t m = 0; m < a.M; m += kTileRows) {
      const int mr = (int)(a.M - m < kTileRows ? a.M - m : kTileRows);
      tile_any(a, m, mr, b, nb);
    }
  }
}

}  // namespace pagemill::int8
