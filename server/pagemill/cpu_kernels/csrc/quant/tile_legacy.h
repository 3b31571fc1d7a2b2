// The vector tile for the 32-element types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): one repacked group
// (8 output columns) against MR activation rows, over all of K.
//
// Per block of 32: the group's quants are unpacked once into 8 (Q8_0) or 2 x 4 vectors of
// 8 columns x 4 k, and each serves the MR rows from registers; the int32 sums are exact, then
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

// How far ahead a weight stream asks for its lines (bytes).
constexpr int64_t kAhead = 1536;

// One group block's products with MR rows (x[r]: row r's 32 activations of this block).
template <int kType, int MR>
inline void legacy_products(const uint8_t* g, const int8_t* const* x, Sum (&s)[MR]) {
  constexpr X8 o = x8_offsets(kType);
  if constexpr (kType == kQ8_0) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256i w = load(g + o.runs + 32 * i), w_abs = _mm256_abs_epi8(w);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        s[r].add_signed(w_abs, w, x[r] + 4 * i);
        s[r].flush();  // 2 * 128 * 127 leaves no room for a second product in int16
      }
    }
  } else {
    constexpr bool five = o.bits >= 0;
    const __m256i h = five ? load(g + o.bits) : _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m256i w = load(g + o.runs + 32 * i);
      __m256i lo = low4(w), hi = high4(w);
      if (five) {
        lo = _mm256_or_si256(lo, bit_to_4(h, i));
        hi = _mm256_or_si256(hi, bit_to_4(h, 4 + i));
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        s[r].add(lo, x[r] + 4 * i);
        s[r].add(hi, x[r] + 16 + 4 * i);
        if (five && i == 1) s[r].flush();  // 4 products of 5-bit quants fill int16
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) s[r].flush();
  }
}

// The block's sums through its scales into the MR rows' float accumulators.
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

// Rows [r0, r0 + MR) x the group at gp (blocks of K / 32) -> out[r][c]; ahead: ask for the
// stream's next lines (the first pass over a group).
template <int kType, int MR>
void legacy_tile(const uint8_t* gp, int64_t blocks, const Acts& a, int64_t r0, bool ahead, float (*out)[8]) {
  const int64_t gb = group_block_bytes(kType);
  const RowsOf<MR> rows(a, r0);
  __m256 acc[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* g = gp + b * gb;
    if (ahead) ask_ahead(g, gb, kAhead);
    const int8_t* x[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) x[r] = rows.x[r] + 32 * b;
    Sum s[MR];
    legacy_products<kType, MR>(g, x, s);
    legacy_scale<kType, MR>(g, rows, b, s, acc);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out[r], acc[r]);
}

}  // namespace pagemill::quant::simd
#endif
