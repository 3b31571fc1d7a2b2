// RMSNorm of bfloat16 rows, with Hugging Face's casts: normalise in float32,
// round to bf16, multiply by the bf16 weight (rounding the product).
//
// Why: torch spends seven ops on it (widen, square, mean, add, rsqrt, narrow,
// multiply), each a pass over the rows with its own dispatch; at 64 decode
// rows that was ~5% of a bf16 step on the default model (docs/cpu.md). Here
// it is one pass per row. float32 rows keep torch's fused F.rms_norm.
//
// pagemill_add_rms_norm_bf16 also does the residual add before the norm (as
// vLLM's fused_add_rms_norm): s = x + r rounded to bf16 as torch's bf16 add
// rounds it, then the same norm of s, so its results are bit for bit the add
// followed by pagemill_rms_norm_bf16, one pass over the rows instead of two
// calls (an aten add costs ~7 us a layer at 16 decode rows, most of it dispatch).
#include <math.h>
#include <stdint.h>

#include "vec.h"

namespace {

using pagemill::bf16;
using pagemill::from_float;
using pagemill::to_float;

// Not inlined: the plain norm and the add + norm run the very same code (the same order of the
// sum of squares), so they agree bit for bit.
__attribute__((noinline)) void norm_row(const bf16* x, const bf16* w, float eps, int64_t H, bf16* out) {
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
void add_norm_row(const bf16* x, const bf16* r, const bf16* w, float eps, int64_t H, bf16* sum, bf16* out) {
  int64_t h = 0;
#if defined(__AVX512F__)
  for (; h + 16 <= H; h += 16)
    _mm256_storeu_si256((__m256i*)(sum + h),
                        pagemill::narrow_bf16(_mm512_add_ps(pagemill::load16(x + h), pagemill::load16(r + h))));
#endif
  for (; h < H; ++h) sum[h] = from_float<bf16>(to_float(x[h]) + to_float(r[h]));
  norm_row(sum, w, eps, H, out);
}

}  // namespace

extern "C" {

// x [rows, H] with row stride `stride`, out [rows, H] contiguous, w [H]; all bf16.
void pagemill_rms_norm_bf16(const bf16* x, int64_t rows, int64_t H, int64_t stride, const bf16* w, float eps,
                            bf16* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * H >= 32768)
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * stride, w, eps, H, out + r * H);
}

// sum [rows, H] = x + r, out [rows, H] = rms_norm(sum); x and r with row strides x_stride and
// r_stride, sum and out contiguous, w [H]; all bf16. sum may be r itself (r_stride H): the
// add in place.
void pagemill_add_rms_norm_bf16(const bf16* x, int64_t x_stride, const bf16* r, int64_t r_stride, int64_t rows,
                                int64_t H, const bf16* w, float eps, bf16* sum, bf16* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * H >= 32768)
  for (int64_t i = 0; i < rows; ++i)
    add_norm_row(x + i * x_stride, r + i * r_stride, w, eps, H, sum + i * H, out + i * H);
}
}
