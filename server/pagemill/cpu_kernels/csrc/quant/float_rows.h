// The plain path for GGUF's float weights (F32, F16, BF16 rows, kept as they are): each output
// column's row widened to float32 8 elements at a time and multiplied with up to 4 activation
// rows in float32. Lane j of an accumulator sums the elements k = j mod 8; the portable loop
// keeps the same 8 lanes and the same final additions, so both give the same bits.
#pragma once
#include <math.h>
#include <stdint.h>

#include "quant/blocks.h"
#include "quant/dot_simd.h"

namespace pagemill::quant {

// Element k of a float-type row as float32.
inline float float_at(int type, const uint8_t* row, int64_t k) {
  if (type == kF32) return bits_to_float(load_u32(row + 4 * k));
  const uint16_t h = load_u16(row + 2 * k);
  return type == kF16 ? half_to_float(h) : bf16_to_float(h);
}

// (a0 + a4) + (a2 + a6) + ((a1 + a5) + (a3 + a7)): the vector path's final sum of 8 lanes.
inline float sum_lanes(const float* l) {
  const float h0 = l[0] + l[4], h1 = l[1] + l[5], h2 = l[2] + l[6], h3 = l[3] + l[7];
  return (h0 + h2) + (h1 + h3);
}

inline void float_dots_portable(int type, const uint8_t* w, const float* x, int64_t ldx, int64_t K, int mr, float* out) {
  float acc[4][8] = {};
  for (int64_t k0 = 0; k0 < K; k0 += 8)
    for (int j = 0; j < 8; ++j) {
      const int64_t k = k0 + j;
      const float wk = k < K ? float_at(type, w, k) : 0.f;
      for (int r = 0; r < mr; ++r) acc[r][j] = fmaf(wk, k < K ? x[r * ldx + k] : 0.f, acc[r][j]);
    }
  for (int r = 0; r < mr; ++r) out[r] = sum_lanes(acc[r]);
}

#if defined(PAGEMILL_QUANT_SIMD)
// 8 elements of a float-type row from k (k + 8 <= K) as float32.
inline __m256 float8(int type, const uint8_t* w, int64_t k) {
  if (type == kF32) return _mm256_loadu_ps((const float*)w + k);
  const __m128i h = _mm_loadu_si128((const __m128i*)(w + 2 * k));
  if (type == kF16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int MR>
void float_dots(int type, const uint8_t* w, const float* x, int64_t ldx, int64_t K, float* out) {
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = float8(type, w, k);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * ldx + k), acc[r]);
  }
  alignas(32) float tw[8] = {}, tx[8];
  for (int j = 0; k + j < K; ++j) tw[j] = float_at(type, w, k + j);
  for (int r = 0; r < MR; ++r) {
    if (k < K) {  // the last K % 8 elements, zero-padded as the portable loop pads them
      for (int j = 0; j < 8; ++j) tx[j] = k + j < K ? x[r * ldx + k + j] : 0.f;
      acc[r] = _mm256_fmadd_ps(_mm256_load_ps(tw), _mm256_load_ps(tx), acc[r]);
    }
    alignas(32) float l[8];
    _mm256_store_ps(l, acc[r]);
    out[r] = sum_lanes(l);
  }
}
#endif

// out[r] = row w . x[r] (r < mr <= 4; x rows ldx floats apart).
inline void float_dots_any(int type, const uint8_t* w, const float* x, int64_t ldx, int64_t K, int mr, float* out) {
#if defined(PAGEMILL_QUANT_SIMD)
  switch (mr) {
    case 4: return float_dots<4>(type, w, x, ldx, K, out);
    case 3: return float_dots<3>(type, w, x, ldx, K, out);
    case 2: return float_dots<2>(type, w, x, ldx, K, out);
    default: return float_dots<1>(type, w, x, ldx, K, out);
  }
#else
  float_dots_portable(type, w, x, ldx, K, mr, out);
#endif
}

}  // namespace pagemill::quant
