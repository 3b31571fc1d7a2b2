// Activations quantized per row on every call, the way ggml quantizes them for its int8 dot
// products (its x86 paths), so that the sums are llama.cpp's:
//
// - blocks of 32 for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 weights (ggml's Q8_0/Q8_1): amax = max |x|,
//   q = round_half_even(x * (127 / amax)), d = amax / 127 stored as f16 (kept here as the float
//   of that f16), and the block's sum of q (Q8_1's s = d * sum; kept as the integer sum);
// - blocks of 256 for the K-quants (ggml's Q8_K): max = the first x of largest |x|,
//   iscale = -127 / max, q = min(127, round_half_even(iscale * x)), d = 1 / iscale, and the
//   sums of q per 16 (bsums) and per 32.
//
// The AVX2 and portable loops make the same float operations per element, so they give the
// same bytes (NaN inputs map to -127 on both; the output is then meaningless, not a crash).
#pragma once
#include <math.h>
#include <stdint.h>

#include "quant/blocks.h"

#if defined(__AVX2__) && !defined(PAGEMILL_QUANT_PORTABLE)
#include <immintrin.h>
#define PAGEMILL_QUANT_AVX2_ROWS 1
#endif

namespace pagemill::quant {

// Quantized activation rows, row m at q + m * K etc. (the buffers are the caller's).
struct Acts {
  int8_t* q = nullptr;  // [M][K]
  float* d = nullptr;  // [M][K / blk]: the block scales
  int16_t* s32 = nullptr;  // [M][K / 32]: sums of q per 32
  int16_t* s16 = nullptr;  // [M][K / 16]: sums of q per 16 (K-quant activations only)
  int64_t K = 0;
  int blk = 32;  // 32 (legacy weights) or 256 (K-quants)
  const int8_t* row(int64_t m) const { return q + m * K; }
  const float* scales(int64_t m) const { return d + m * (K / blk); }
  const int16_t* sums32(int64_t m) const { return s32 + m * (K / 32); }
  const int16_t* sums16(int64_t m) const { return s16 + m * (K / 16); }
};

// Rows [r0, r0 + MR) of a, their pointers computed once per tile (not per block).
template <int MR>
struct RowsOf {
  const int8_t* x[MR];
  const float* d[MR];
  const int16_t* s32[MR];
  const int16_t* s16[MR];
  RowsOf(const Acts& a, int64_t r0) {
    for (int r = 0; r < MR; ++r) {
      x[r] = a.row(r0 + r);
      d[r] = a.scales(r0 + r);
      s32[r] = a.sums32(r0 + r);
      s16[r] = a.s16 ? a.sums16(r0 + r) : nullptr;
    }
  }
};

// Bytes of the buffer acts_in() carves for M rows of K (K a multiple of blk).
inline int64_t acts_bytes(int64_t M, int64_t K, int blk) {
  return M * K + M * (K / blk) * 4 + M * (K / 32) * 2 + (blk == kQK ? M * (K / 16) * 2 : 0) + 64;
}

inline Acts acts_in(void* buf, int64_t M, int64_t K, int blk) {
  Acts a;
  a.K = K;
  a.blk = blk;
  char* p = (char*)buf;
  a.d = (float*)p;  // the 4-byte arrays first: every pointer stays aligned
  p += M * (K / blk) * 4;
  a.s32 = (int16_t*)p;
  p += M * (K / 32) * 2;
  a.s16 = blk == kQK ? (int16_t*)p : nullptr;
  p += blk == kQK ? M * (K / 16) * 2 : 0;
  a.q = (int8_t*)p;
  return a;
}

// round_half_even(v) clamped to [-127, 127] (NaN -> -127), as the vector path computes it.
inline int8_t to_q8(float v) {
  v = nearbyintf(v);  // default rounding mode: half to even, as vroundps and ggml's nearest_int
  v = fmaxf(v, -127.f);  // a NaN gives -127, as vmaxps(v, -127) does
  return (int8_t)fminf(v, 127.f);
}

inline float max_abs(const float* x, int n) {
  float amax = 0.f;
#if defined(PAGEMILL_QUANT_AVX2_ROWS)
  if (n % 8 == 0) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();  // vmaxps(new, m) keeps m where new is NaN, as fmaxf
    for (int t = 0; t < n; t += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + t)), m);
    alignas(32) float l[8];
    _mm256_store_ps(l, m);
    for (int t = 0; t < 8; ++t) amax = fmaxf(amax, l[t]);
    return amax;
  }
#endif
  for (int t = 0; t < n; ++t) amax = fmaxf(amax, fabsf(x[t]));
  return amax;
}

// q[t] = to_q8(x[t] * scale) for t < n.
inline void scale_round(const float* x, int n, float scale, int8_t* q) {
  int t = 0;
#if defined(PAGEMILL_QUANT_AVX2_ROWS)
  const __m256 s = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (; t + 32 <= n; t += 32) {
    __m256i v[4];
    for (int i = 0; i < 4; ++i) {
      __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + t + 8 * i), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    // packs work per 128-bit half: the dword permute puts the 32 bytes back in order
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i*)(q + t), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
#endif
  for (; t < n; ++t) q[t] = to_q8(x[t] * scale);
}

// sums[j] = sum of q[span j .. span j + span) for j < n / span.
inline void block_sums(const int8_t* q, int n, int span, int16_t* sums) {
  for (int j = 0; j < n / span; ++j) {
    int s = 0;
    for (int t = 0; t < span; ++t) s += q[span * j + t];
    sums[j] = (int16_t)s;
  }
}

// One row of K floats (K % 32 == 0) in blocks of 32 (ggml's Q8_0 / Q8_1).
inline void quantize_row_32(const float* x, int64_t K, int8_t* q, float* d, int16_t* s32) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float amax = max_abs(x + 32 * b, 32);
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    d[b] = half_to_float(float_to_half(amax / 127.f));
    scale_round(x + 32 * b, 32, id, q + 32 * b);
  }
  block_sums(q, (int)K, 32, s32);
}

// One row of K floats (K % 256 == 0) in blocks of 256 (ggml's Q8_K).
inline void quantize_row_256(const float* x, int64_t K, int8_t* q, float* d, int16_t* s16, int16_t* s32) {
  for (int64_t b = 0; b < K / kQK; ++b) {
    const float* xb = x + kQK * b;
    const float amax = max_abs(xb, kQK);
    if (!(amax > 0.f)) {  // all zero (or all NaN): ggml's zero block
      d[b] = 0.f;
      for (int t = 0; t < kQK; ++t) q[kQK * b + t] = 0;
      continue;
    }
    int first = 0;  // ggml keeps the first x of the largest magnitude, sign included
    while (fabsf(xb[first]) != amax) ++first;
    const float iscale = -127.f / xb[first];
    scale_round(xb, kQK, iscale, q + kQK * b);
    d[b] = 1.f / iscale;
  }
  block_sums(q, (int)K, 16, s16);
  block_sums(q, (int)K, 32, s32);
}

// Row m of x (float32, or bfloat16 bits when bf16) into a; tmp holds K floats for bf16 rows.
inline void quantize_row(const void* x, bool bf16, int64_t m, const Acts& a, float* tmp) {
  const float* xf = (const float*)x + m * a.K;
  if (bf16) {
    const uint16_t* h = (const uint16_t*)x + m * a.K;
    for (int64_t k = 0; k < a.K; ++k) tmp[k] = bf16_to_float(h[k]);
    xf = tmp;
  }
  int8_t* q = a.q + m * a.K;
  float* d = a.d + m * (a.K / a.blk);
  int16_t* s32 = a.s32 + m * (a.K / 32);
  if (a.blk == kQK)
    quantize_row_256(xf, a.K, q, d, a.s16 + m * (a.K / 16), s32);
  else
    quantize_row_32(xf, a.K, q, d, s32);
}

}  // namespace pagemill::quant
