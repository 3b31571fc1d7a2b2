// The vector tile for the K-quants (Q4_K, Q5_K, Q6_K): repacked groups (8 output columns each)
// against MR activation rows (ggml's Q8_K: one scale per 256), over all of K.
//
// Per super-block of 256, exact int32 sums per column, then in float32 (as tile_scalar.h):
//   Q4_K/Q5_K: isum = sum_j sc_j * (quants . activations over run j of 32)
//              msum = sum_j m_j * xsum32_j
//              acc = fma(float(isum), dw * dx, acc); acc = fma(float(msum), dmin * -dx, acc)
//   Q6_K:      isum = sum_s sc_s * (q . x over 16) - 32 * sum_s sc_s * xsum16_s
//              acc = fma(float(isum), dw * dx, acc)
// which are ggml's sums (its Q6_K subtracts the 32 per product; the same integer). The
// sub-block scales multiply the int16 partials in vpmaddwd (dot_simd.h's Sum::flush(scale));
// the mins and Q6_K's offset meet the activations' per-16/32 sums in a few vpmaddwd per
// super-block, not per product.
#pragma once
#include <stdint.h>

#include "quant/dot_simd.h"
#include "quant/quantize_rows.h"
#include "quant/repack.h"
#include "quant/tile_legacy.h"  // kAhead, kTileGroups

#if defined(PAGEMILL_QUANT_SIMD)
namespace pagemill::quant::simd {

// repack.h's 96 scale bytes of a Q4_K/Q5_K group -> sc[8 j + c], mn[8 j + c] (0..63).
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  const __m256i l0 = load(s), l1 = load(s + 32), h = load(s + 64);
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
  const __m256i sc0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
  const __m256i sc1 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
  const __m256i mn0 = _mm256_or_si256(high4(l0), _mm256_and_si256(h, m30));
  const __m256i mn1 = _mm256_or_si256(high4(l1), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
  _mm256_store_si256((__m256i*)sc, sc0);
  _mm256_store_si256((__m256i*)(sc + 32), sc1);
  _mm256_store_si256((__m256i*)mn, mn0);
  _mm256_store_si256((__m256i*)(mn + 32), mn1);
}

// A Q4_K/Q5_K group super-block's products with MR rows, each run of 32 through its scale.
template <int kType, int MR>
inline void k45_products(const uint8_t* g, const int8_t* const* x, const uint8_t* sc, Sum (&s)[MR]) {
  constexpr X8 o = x8_offsets(kType);
  constexpr bool five = kType == kQ5_K;
  for (int q = 0; q < 8; ++q) {
    const __m256i scale = scales_u8(sc + 8 * q);
    const __m256i h = five ? load(g + o.bits + 32 * q) : _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m256i w = load(g + o.runs + 128 * q + 32 * i);
      const __m256i lo = five ? _mm256_or_si256(low4(w), bit_to_4(h, i)) : low4(w);
      const __m256i hi = five ? _mm256_or_si256(high4(w), bit_to_4(h, 4 + i)) : high4(w);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        s[r].add(lo, bcast4(x[r] + 32 * q + 4 * i));
        s[r].add(hi, bcast4(x[r] + 32 * q + 16 + 4 * i));
        if (five && i == 1) s[r].flush(scale);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) s[r].flush(scale);
  }
}

// A Q6_K group super-block's products with MR rows: per run of 32, its first 16 (low nibbles)
// and last 16 (high nibbles) under their own scales; 2 products of 6-bit quants fill int16.
template <int MR>
inline void q6_products(const uint8_t* g, const int8_t* const* x, Sum (&s)[MR]) {
  constexpr X8 o = x8_offsets(kQ6_K);
  for (int q = 0; q < 8; ++q)
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const __m256i scale = scales_i8(g + o.scales + 8 * (2 * q + half));
      const __m256i h = load(g + o.bits + 64 * q + 32 * half);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256i v = load(g + o.runs + 128 * q + 32 * i);
        const __m256i w = _mm256_or_si256(half ? high4(v) : low4(v), bits_to_45(h, 2 * i));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          s[r].add(w, bcast4(x[r] + 32 * q + 16 * half + 4 * i));
          if (i & 1) s[r].flush(scale);
        }
      }
    }
}

// One group's super-block sums through d (and dmin) into the MR rows' accumulators; mn: the
// group's decoded mins (Q4_K/Q5_K).
template <int kType, int MR>
inline void k_scale(const uint8_t* g, const uint8_t* mn, const RowsOf<MR>& rows, int64_t b, Sum (&s)[MR],
                    __m256 (&acc)[MR]) {  // fmt: skip
  constexpr X8 o = x8_offsets(kType);
  const __m256 dw = halves(g + o.d);
  if constexpr (kType == kQ6_K) {
    __m256i p[8];  // (sc_2k, sc_2k+1) per column, against the activations' sums per 16
    for (int k = 0; k < 8; ++k) p[k] = pairs_i8(g + o.scales + 16 * k, g + o.scales + 16 * k + 8);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256i corr = pair_products(p, rows.s16[r] + 16 * b, 8);
      const __m256i t = _mm256_sub_epi32(s[r].total, _mm256_slli_epi32(corr, 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, _mm256_set1_ps(rows.d[r][b])), acc[r]);
    }
  } else {
    __m256i p[4];  // (m_2k, m_2k+1) per column, against the activations' sums per 32
    for (int k = 0; k < 4; ++k) p[k] = pairs_u8(mn + 16 * k, mn + 16 * k + 8);
    const __m256 dmin = halves(g + o.m);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const float dx = rows.d[r][b];
      const __m256i msum = pair_products(p, rows.s32[r] + 8 * b, 4);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r].total), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, _mm256_set1_ps(-dx)), acc[r]);
    }
  }
}

// Rows [r0, r0 + MR) x one group at gp, all of K -> acc.
template <int kType, int MR>
void k_group(const uint8_t* gp, int64_t blocks, const RowsOf<MR>& rows, bool ahead, __m256 (&acc)[MR]) {
  const int64_t gb = group_block_bytes(kType);
  alignas(32) uint8_t sc[64], mn[64];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* g = gp + b * gb;
    if (ahead) ask_ahead(g, gb, kAhead);
    const int8_t* x[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) x[r] = rows.x[r] + kQK * b;
    Sum s[MR];
    if constexpr (kType == kQ6_K) {
      q6_products<MR>(g, x, s);
    } else {
      k_scales(g + x8_offsets(kType).scales, sc, mn);
      k45_products<kType, MR>(g, x, sc, s);
    }
    k_scale<kType, MR>(g, mn, rows, b, s, acc);
  }
}

// Rows [r0, r0 + MR) x the groups at gp (blocks: K / 256 super-blocks) -> out[r][8 j + c]. One
// group at a time: a super-block keeps an int32 sum per row and group live across its 8 runs,
// and two groups' sums and partials (16 registers at 4 rows) spilled (measured: no gain).
template <int kType, int MR>
void k_tile(const GroupPtrs& gp, int64_t blocks, const Acts& a, int64_t r0, bool ahead, float (*out)[16]) {
  const RowsOf<MR> rows(a, r0);
  for (int j = 0; j < kTileGroups && (j == 0 || gp[j] != gp[0]); ++j) {
    __m256 acc[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    k_group<kType, MR>(gp[j], blocks, rows, ahead, acc);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out[r] + 8 * j, acc[r]);
  }
}

}  // namespace pagemill::quant::simd
#endif
