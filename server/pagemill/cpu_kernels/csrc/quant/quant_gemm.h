// y[M, N] = x[M, K] @ W^T for GGUF-quantized W, on one thread, for a contiguous range of
// output columns: the entry quant.cpp's linear splits among its threads and a fused layer can
// call per thread (with activations it quantized once, quantize_rows.h).
//
// W is a prepared weight (repack.h: groups of 8 rows, then the N % 8 last rows as GGUF rows,
// packed per call into a scratch group by pack_tail). Work order, per thread: rows in chunks
// whose int8 activations stay in L2 (kActsL2), and per chunk each pair of groups (16 columns)
// against tiles of 4 rows over all of K: each group block unpacked once serves the 4 rows from
// registers, and at 1 row a thread streams its groups' bytes once, in order, asking ahead.
//
// From a fused layer (per linear; quant.cpp's linear_quant does the same):
//   const int blk = acts_block(type);                       // 32, or 256 for the K-quants
//   Acts a = acts_in(buf, M, K, blk);                      // buf: acts_bytes(M, K, blk) bytes
//   for (m...) quantize_row(x, x_is_bf16, m, a, tmp);      // once per input and block size:
//                                                          // q/k/v of one input share it
//   Weight w{type, prepared_bytes, N, K};
//   pack_tail(w, tail_buf);                                // 8 * row_bytes, once at load is fine
//   per thread: gemm_range(w, a, M, n0, n1, out);          // its columns; out.add for residuals
// Column ranges starting at a multiple of 16 keep each tile's two groups in one thread.
#pragma once
#include <stdint.h>

#include "quant/blocks.h"
#include "quant/quantize_rows.h"
#include "quant/repack.h"
#include "quant/tile_kquants.h"
#include "quant/tile_legacy.h"
#include "quant/tile_scalar.h"

namespace pagemill::quant {

constexpr int kTileRows = 4;
constexpr int64_t kActsL2 = 320 << 10;  // int8 activation bytes a row chunk keeps in L2

struct Weight {
  int type = 0;
  const uint8_t* data = nullptr;  // the prepared bytes: N rows of row_bytes(type, K)
  int64_t N = 0, K = 0;
  const uint8_t* tail = nullptr;  // pack_tail's group of the last N % 8 rows (null if none)
};

struct Out {
  void* y = nullptr;  // [M][ld] float32, or bfloat16 bits
  int64_t ld = 0;
  bool bf16 = false;
  bool add = false;  // float32 only: y += the product (a fused layer's residual)
  const float* bias = nullptr;  // [N] or null
};

// The block size of the activations a quantized type multiplies (quantize_rows.h's Acts.blk).
inline int acts_block(int type) { return is_k_quant(type) ? kQK : 32; }

// Group g's first byte (g == N / 8 with N % 8 rows left: the packed tail).
inline const uint8_t* group_at(const Weight& w, int64_t g) {
  return g < w.N / kGroup ? w.data + g * kGroup * row_bytes(w.type, w.K) : w.tail;
}

// The last N % 8 rows of w.data as one group in scratch (8 * row_bytes bytes); w.tail = it.
inline void pack_tail(Weight& w, uint8_t* scratch) {
  const int64_t rows = w.N % kGroup, rb = row_bytes(w.type, w.K);
  w.tail = nullptr;
  if (rows == 0) return;
  pack_group(w.type, w.data + (w.N - rows) * rb, rb, (int)rows, w.K, scratch);
  w.tail = scratch;
}

#if defined(PAGEMILL_QUANT_SIMD)
// 8 floats -> bfloat16 bits, as float_to_bf16 rounds each (nearest even, NaN kept quiet).
inline __m128i narrow_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// store_row's first count - count % 8 outputs, 8 at a time; returns how many it wrote.
inline int64_t store_row8(const Out& o, int64_t m, int64_t n, int64_t count, const float* v) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    __m256 r = _mm256_loadu_ps(v + i);
    if (o.bias) r = _mm256_add_ps(r, _mm256_loadu_ps(o.bias + n + i));
    if (o.bf16) {
      _mm_storeu_si128((__m128i*)((uint16_t*)o.y + m * o.ld + n + i), narrow_bf16_8(r));
    } else {
      float* y = (float*)o.y + m * o.ld + n + i;
      _mm256_storeu_ps(y, o.add ? _mm256_add_ps(_mm256_loadu_ps(y), r) : r);
    }
  }
  return i;
}
#endif

// Outputs [n, n + count) of row m: v (+ bias), rounded to bf16 or added to y as o asks.
inline void store_row(const Out& o, int64_t m, int64_t n, int64_t count, const float* v) {
  int64_t i = 0;
#if defined(PAGEMILL_QUANT_SIMD)
  i = store_row8(o, m, n, count, v);
#endif
  for (; i < count; ++i) {
    const float r = o.bias ? v[i] + o.bias[n + i] : v[i];
    if (o.bf16)
      ((uint16_t*)o.y)[m * o.ld + n + i] = float_to_bf16(r);
    else
      ((float*)o.y)[m * o.ld + n + i] = o.add ? ((float*)o.y)[m * o.ld + n + i] + r : r;
  }
}

constexpr int kTileGroups = 2;  // groups a tile takes at once (tile_legacy.h says why)
#if defined(PAGEMILL_QUANT_SIMD)
static_assert(simd::kTileGroups == kTileGroups, "one tile width");

template <int MR>
void tile_simd(int type, const uint8_t* const (&gp)[2], int64_t blocks, const Acts& a, int64_t r0, bool ahead,
               float (*out)[16]) {  // fmt: skip
  switch (type) {
    case kQ8_0: return simd::legacy_tile<kQ8_0, MR>(gp, blocks, a, r0, ahead, out);
    case kQ4_0: return simd::legacy_tile<kQ4_0, MR>(gp, blocks, a, r0, ahead, out);
    case kQ4_1: return simd::legacy_tile<kQ4_1, MR>(gp, blocks, a, r0, ahead, out);
    case kQ5_0: return simd::legacy_tile<kQ5_0, MR>(gp, blocks, a, r0, ahead, out);
    case kQ5_1: return simd::legacy_tile<kQ5_1, MR>(gp, blocks, a, r0, ahead, out);
    case kQ4_K: return simd::k_tile<kQ4_K, MR>(gp, blocks, a, r0, ahead, out);
    case kQ5_K: return simd::k_tile<kQ5_K, MR>(gp, blocks, a, r0, ahead, out);
    case kQ6_K: return simd::k_tile<kQ6_K, MR>(gp, blocks, a, r0, ahead, out);
    default: return;
  }
}
#endif

// Rows [r0, r0 + mr) (mr <= kTileRows) x the two groups at gp -> out[r][8 j + c] (gp[1] may
// repeat gp[0]: an odd last group, its copy's columns not stored).
inline void tile(int type, const uint8_t* const (&gp)[2], int64_t blocks, const Acts& a, int64_t r0, int mr,
                 bool ahead, float (*out)[16]) {  // fmt: skip
#if defined(PAGEMILL_QUANT_SIMD)
  switch (mr) {
    case 4: return tile_simd<4>(type, gp, blocks, a, r0, ahead, out);
    case 3: return tile_simd<3>(type, gp, blocks, a, r0, ahead, out);
    case 2: return tile_simd<2>(type, gp, blocks, a, r0, ahead, out);
    default: return tile_simd<1>(type, gp, blocks, a, r0, ahead, out);
  }
#else
  (void)ahead;
  for (int j = 0; j < kTileGroups && (j == 0 || gp[j] != gp[0]); ++j) {
    float one[kTileRows][8];
    scalar::tile(type, gp[j], blocks, a, r0, mr, one);
    for (int r = 0; r < mr; ++r)
      for (int c = 0; c < 8; ++c) out[r][8 * j + c] = one[r][c];
  }
#endif
}

// y[m, n] for m < M, n0 <= n < n1 (a quantized type; a: the M rows quantized for it).
inline void gemm_range(const Weight& w, const Acts& a, int64_t M, int64_t n0, int64_t n1, const Out& o) {
  const int64_t blocks = w.K / layout(w.type).elems, span = kTileGroups * kGroup;
  int64_t chunk = kActsL2 / w.K / kTileRows * kTileRows;
  chunk = chunk < kTileRows ? kTileRows : chunk;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = m0 + chunk < M ? m0 + chunk : M;
    for (int64_t g = n0 / kGroup; g * kGroup < n1; g += kTileGroups) {
      const uint8_t* const gp[2] = {group_at(w, g), (g + 1) * kGroup < n1 ? group_at(w, g + 1) : group_at(w, g)};
      const int64_t first = g * kGroup, lo = first > n0 ? first : n0, hi = first + span < n1 ? first + span : n1;
      for (int64_t r0 = m0; r0 < m1; r0 += kTileRows) {
        const int mr = (int)(m1 - r0 < kTileRows ? m1 - r0 : kTileRows);
        alignas(32) float acc[kTileRows][16];
        tile(w.type, gp, blocks, a, r0, mr, r0 == m0, acc);
        for (int r = 0; r < mr; ++r) store_row(o, r0 + r, lo, hi - lo, acc[r] + (lo - first));
      }
    }
  }
}

}  // namespace pagemill::quant
