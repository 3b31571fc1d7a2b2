// The bfloat16 element-wise ops of a decoder layer, one pass each: SwiGLU's
// silu(gate) * up and rotary embedding of the q and k heads.
//
// Why: in bf16, torch runs silu, the multiply and rotary's six ops (two
// multiplies, a negation, a concatenation, an add, the slices) as separate
// passes, each widening and narrowing every element and each its own
// parallel region (a barrier that waits on a descheduled thread when the
// cores are shared). Each pass here reads its inputs once: at 48 rows, one
// thread, silu*up 77 -> 66 us and rotary 65 -> 26 us per layer.
//
// The roundings are Hugging Face's bf16 modules' (each torch op rounds its
// result to bf16): silu(g) rounded, then the product rounded; x*cos and
// rotate_half(x)*sin rounded, then their sum. Only exp differs (a polynomial,
// relative error ~2e-7), which can move a result by one bf16 step in rare ties.
#include <math.h>
#include <stdint.h>

#include "paged_attention.h"  // exp_nonpositive
#include "vec.h"

namespace {

using pagemill::bf16;
using pagemill::from_float;
using pagemill::to_float;

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

void silu_mul_row(const bf16* gate, const bf16* up, int64_t n, bf16* out) {
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
void rotary_head(const bf16* x, const bf16* cos, const bf16* sin, int64_t D, bf16* out) {
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

}  // namespace

extern "C" {

// out[r, j] = silu(x[r, j]) * x[r, n + j] for rows r < rows (x's row stride `stride`), out [rows, n]; bf16.
void pagemill_silu_mul_bf16(const bf16* x, int64_t rows, int64_t n, int64_t stride, bf16* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 65536)
  for (int64_t r = 0; r < rows; ++r) silu_mul_row(x + r * stride, x + r * stride + n, n, out + r * n);
}

// out [T, heads, D] = rotary(x) for x's first `heads` heads of each token (x: token t's head h at
// x + t * stride + h * D); cos, sin [T, D]; all bf16.
void pagemill_rotary_bf16(const bf16* x, int64_t T, int64_t heads, int64_t D, int64_t stride, const bf16* cos,
                          const bf16* sin, bf16* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T * heads * D >= 65536)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h)
      rotary_head(x + t * stride + h * D, cos + t * D, sin + t * D, D, out + (t * heads + h) * D);
}
}
