// The row-wise bfloat16 operations of a decoder layer, with Hugging Face's
// bf16 roundings: RMSNorm (and the residual add before it), SwiGLU's
// silu(gate) * up, rotary of one head. norm.cpp and elementwise.cpp call them
// one op per call (the module path); decode_batched.cpp calls them inside its
// whole-layer region. One definition for both, so the two paths agree bit for
// bit (tests/test_batched_decode.py checks it).
//
// RMSNorm: normalise in float32, round to bf16, multiply by the bf16 weight
// (rounding the product). The add: s = x + r rounded to bf16 as torch's bf16
// add rounds it. silu * up: silu(g) rounded, then the product rounded. Rotary:
// x*cos and rotate_half(x)*sin rounded, then their sum. Only exp differs from
// torch (a polynomial, relative error ~2e-7), which can move a result by one
// bf16 step in rare ties.
#pragma once
#include <math.h>
#include <stdint.h>

#include "common/simd_math.h"  // exp_nonpositive
#include "common/vec.h"

namespace pagemill::rows {

using pagemill::bf16;
using pagemill::from_float;
using pagemill::to_float;

// Not inlined: the plain norm and the add + norm run the very same code (the same order of the
// sum of squares), so they agree bit for bit.
__attribute__((noinline)) inline void norm_row(const bf16* x, const bf16* w, float eps, int64_t H, bf16* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t h = 0; h < H; ++h) ss += to_float(x[h]) * to_float(x[h]);
  const float r = 1.f / sqrtf(ss / (float)H + eps);
  int64_t h = 0;
#if defined(__AVX512F__)
  // Element by element (no order to keep): the same two roundings, 16 lanes at a time.
  const __m512 rv = _mm512_set1_ps(r);
  for (; h + 16 <= H; h += 16) {
    const __m256i normed = pagemill::narrow_bf16(_mm512_mul_ps(pagemill::load16(x + h), rv));
    const __m512 widened = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(normed), 16));
    _mm256_storeu_si256((__m256i*)(out + h), pagemill::narrow_bf16(_mm512_mul_ps(pagemill::load16(w + h), widened)));
  }
#endif
  for (; h < H; ++h) {
    const float normed = to_float(from_float<bf16>(to_float(x[h]) * r));
    out[h] = from_float<bf16>(to_float(w[h]) * normed);
  }
}

// sum = x + r (bf16 rounding), then out = norm(sum).
inline void add_norm_row(const bf16* x, const bf16* r, const bf16* w, float eps, int64_t H, bf16* sum, bf16* out) {
  int64_t h = 0;
#if defined(__AVX512F__)
  for (; h + 16 <= H; h += 16)
    _mm256_storeu_si256((__m256i*)(sum + h),
                        pagemill::narrow_bf16(_mm512_add_ps(pagemill::load16(x + h), pagemill::load16(r + h))));
#endif
  for (; h < H; ++h) sum[h] = from_float<bf16>(to_float(x[h]) + to_float(r[h]));
  norm_row(sum, w, eps, H, out);
}

inline float round_bf16(float f) { return to_float(from_float<bf16>(f)); }

inline float silu(float g) { return g / (1.f + expf(-g)); }

#if defined(__AVX512F__)
inline __m512 round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pagemill::narrow_bf16(v)), 16));
}
inline void store16(bf16* p, __m512 v, int64_t n) {
  const __m256i b = pagemill::narrow_bf16(v);
  if (n >= 16)
    _mm256_storeu_si256((__m256i*)p, b);
  else
    _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), b);
}
// silu(g) = g * sigmoid(g), sigmoid through e = exp(-|g|) <= 1 so exp never overflows.
inline __m512 silu16(__m512 g) {
  const __m512 e = pagemill::exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 sig = _mm512_mask_mul_ps(inv, neg, inv, e);  // g < 0: e / (1 + e)
  return _mm512_mul_ps(g, sig);
}
#endif

inline void silu_mul_row(const bf16* gate, const bf16* up, int64_t n, bf16* out) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j < n; j += 16) {
    const int64_t m = n - j < 16 ? n - j : 16;
    const __m512 s = round16(silu16(pagemill::load16(gate + j, m)));
    store16(out + j, _mm512_mul_ps(s, pagemill::load16(up + j, m)), m);
  }
#endif
  for (; j < n; ++j) out[j] = from_float<bf16>(round_bf16(silu(to_float(gate[j]))) * to_float(up[j]));
}

// One head of one token: HF's x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
inline void rotary_head(const bf16* x, const bf16* cos, const bf16* sin, int64_t D, bf16* out) {
  const int64_t half = D / 2;
  int64_t d = 0;
#if defined(__AVX512F__)
  if (half % 16 == 0) {
    for (; d < half; d += 16) {
      const __m512 x1 = pagemill::load16(x + d), x2 = pagemill::load16(x + half + d);
      const __m512 c1 = pagemill::load16(cos + d), c2 = pagemill::load16(cos + half + d);
      const __m512 s1 = pagemill::load16(sin + d), s2 = pagemill::load16(sin + half + d);
      const __m512 lo = _mm512_add_ps(round16(_mm512_mul_ps(x1, c1)),
                                      round16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1)));
      const __m512 hi = _mm512_add_ps(round16(_mm512_mul_ps(x2, c2)), round16(_mm512_mul_ps(x1, s2)));
      store16(out + d, lo, 16);
      store16(out + half + d, hi, 16);
    }
    return;
  }
#endif
  for (; d < D; ++d) {
    const float xd = to_float(x[d]);
    const float rot = d < half ? -to_float(x[d + half]) : to_float(x[d - half]);
    out[d] = from_float<bf16>(round_bf16(xd * to_float(cos[d])) + round_bf16(rot * to_float(sin[d])));
  }
}

}  // namespace pagemill::rows
