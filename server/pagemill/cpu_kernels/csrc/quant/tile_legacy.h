// The vector tile for the 32-element types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): two repacked groups
// (16 output columns) against MR activation rows, over all of K.
//
// Per block of 32: each group's quants are unpacked once into 8 (Q8_0) or 2 x 4 vectors of
// 8 columns x 4 k, and each serves the MR rows from registers (each activation broadcast
// serves both groups); the int32 sums are exact, then
// each column's lane takes, in float32 (tile_scalar.h makes the same operations):
//   acc = fma(float(isum - off * xsum), dw * dx, acc)       off: 8 (Q4_0), 16 (Q5_0), else 0
//   acc = fma(mw, dx * float(xsum), acc)                   Q4_1 / Q5_1: the min's part
// with isum the block's sum of (unsigned or Q8_0's signed) quants times activations, xsum the
// activation block's sum of quants, dw / mw the column's f16 scale and min, dx the activation
// block's scale. ggml computes the same sum as d * (q - off) products; the offset is taken out
// so that the weights stay unsigned (vpmaddubsw's unsigned operand, no sign fix-ups), and the
// min's part uses dx * xsum in float32 where ggml rounds it to f16 (Q8_1's s).
#pragma once
#include <stdint.h>

#include "quant/dot_simd.h"
#include "quant/quantize_rows.h"
#include "quant/repack.h"

#if defined(PAGEMILL_QUANT_SIMD)
namespace pagemill::quant::simd {

// How far ahead a weight stream asks for its lines (bytes). A tile's two groups are adjacent, so
// the distance must reach past the pair (a Q5_0 group of 640 inputs is 3.5 KB) to keep lines in
// flight. Measured at 1 row on the 2-vCPU Zen 3 (shared, load ~5; two runs, reversed order): 24
// Q5_0 [4096 x 640] linears in turn (43 MB, a Gemma 3 270M step's share) 6.6-8.0 ms min at
// 1536, 3.3-4.2 at 4096-6144; the 262144 x 640 Q8_0 head unchanged within the noise (16-21 ms).
// -DPAGEMILL_QUANT_AHEAD=N overrides it (to measure).
#ifndef PAGEMILL_QUANT_AHEAD
#define PAGEMILL_QUANT_AHEAD 4096
#endif
constexpr int64_t kAhead = PAGEMILL_QUANT_AHEAD;

// Groups per tile: the activation broadcasts serve two groups' weights (measured on the Zen 3:
// a Q4_0 tile of 4 rows went from 125 to 155 GFLOP/s on one core against one group per tile).
constexpr int kTileGroups = 2;
using GroupPtrs = const uint8_t* [kTileGroups];

// The products of one block of each of the tile's groups with MR rows (x[r]: row r's 32
// activations of this block).
template <int kType, int MR>
inline void legacy_products(const GroupPtrs& g, const int8_t* const* x, Sum (&s)[kTileGroups][MR]) {
  constexpr X8 o = x8_offsets(kType);
  constexpr int G = kTileGroups;
  if constexpr (kType == kQ8_0) {
#if defined(PAGEMILL_QUANT_VNNI)
    // vpdpbusd adds into int32, so no sign trick is needed: the activations go offset to
    // unsigned (x + 128, a flip of the top bit) against the signed weights, one instruction per
    // product, and 128 x each column's weight sum (once per block, for all rows) comes off at
    // the end. The same integers as the sign path below, with half its instructions.
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi8(1);
    __m256i wsum[G];
    for (int j = 0; j < G; ++j) wsum[j] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m256i w[G];
      for (int j = 0; j < G; ++j) {
        w[j] = load(g[j] + o.runs + 32 * i);
        wsum[j] = dpbusd(wsum[j], ones, w[j]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256i xu = _mm256_xor_si256(bcast4(x[r] + 4 * i), flip);
        for (int j = 0; j < G; ++j) s[j][r].part = dpbusd(s[j][r].part, xu, w[j]);
      }
    }
    for (int j = 0; j < G; ++j) {
      const __m256i off = _mm256_slli_epi32(wsum[j], 7);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        s[j][r].part = _mm256_sub_epi32(s[j][r].part, off);
        s[j][r].flush();
      }
    }
    return;
#else
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m256i w[G], w_abs[G];
      for (int j = 0; j < G; ++j) {
        w[j] = load(g[j] + o.runs + 32 * i);
        w_abs[j] = _mm256_abs_epi8(w[j]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256i xb = bcast4(x[r] + 4 * i);
        for (int j = 0; j < G; ++j) {
          s[j][r].add_signed(w_abs[j], w[j], xb);
          s[j][r].flush();  // 2 * 128 * 127 leaves no room for a second product in int16
        }
      }
    }
    return;
#endif
  }
  constexpr bool five = o.bits >= 0;
  __m256i h[G];
  for (int j = 0; j < G; ++j) h[j] = five ? load(g[j] + o.bits) : _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    __m256i lo[G], hi[G];
    for (int j = 0; j < G; ++j) {
      const __m256i w = load(g[j] + o.runs + 32 * i);
      lo[j] = five ? _mm256_or_si256(low4(w), bit_to_4(h[j], i)) : low4(w);
      hi[j] = five ? _mm256_or_si256(high4(w), bit_to_4(h[j], 4 + i)) : high4(w);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256i xl = bcast4(x[r] + 4 * i), xh = bcast4(x[r] + 16 + 4 * i);
      for (int j = 0; j < G; ++j) {
        s[j][r].add(lo[j], xl);
        s[j][r].add(hi[j], xh);
        if (five && i == 1) s[j][r].flush();  // 4 products of 5-bit quants fill int16
      }
    }
  }
  for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) s[j][r].flush();
}

// One group block's sums through its scales into the MR rows' float accumulators.
template <int kType, int MR>
inline void legacy_scale(const uint8_t* g, const RowsOf<MR>& rows, int64_t b, Sum (&s)[MR], __m256 (&acc)[MR]) {
  constexpr X8 o = x8_offsets(kType);
  constexpr int off = kType == kQ4_0 ? 8 : (kType == kQ5_0 ? 16 : 0);
  const __m256 dw = halves(g + o.d);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const float dx = rows.d[r][b];
    const int xsum = rows.s32[r][b];
    __m256i t = s[r].total;
    if (off) t = _mm256_sub_epi32(t, _mm256_set1_epi32(off * xsum));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc[r]);
    if (o.m >= 0) acc[r] = _mm256_fmadd_ps(halves(g + o.m), _mm256_set1_ps(dx * (float)xsum), acc[r]);
  }
}

// Rows [r0, r0 + MR) x the groups at gp (blocks of K / 32 each) -> out[r][8 j + c]; ahead: ask
// for the streams' next lines (the first pass over the groups).
template <int kType, int MR>
void legacy_tile(const GroupPtrs& gp, int64_t blocks, const Acts& a, int64_t r0, bool ahead, float (*out)[16]) {
  constexpr int G = kTileGroups;
  const int64_t gb = group_block_bytes(kType);
  const RowsOf<MR> rows(a, r0);
  __m256 acc[G][MR];
  for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    GroupPtrs g;
    for (int j = 0; j < G; ++j) {
      g[j] = gp[j] + b * gb;
      if (ahead) ask_ahead(g[j], gb, kAhead);
    }
    const int8_t* x[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) x[r] = rows.x[r] + 32 * b;
    Sum s[G][MR];
    legacy_products<kType, MR>(g, x, s);
    for (int j = 0; j < G; ++j) legacy_scale<kType, MR>(g[j], rows, b, s[j], acc[j]);
  }
  for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out[r] + 8 * j, acc[j][r]);
}

}  // namespace pagemill::quant::simd
#endif
