// RMSNorm of bfloat16 rows, with Hugging Face's casts: normalise in float32,
// round to bf16, multiply by the bf16 weight (rounding the product).
//
// Why: torch spends seven ops on it (widen, square, mean, add, rsqrt, narrow,
// multiply), each a pass over the rows with its own dispatch; at 64 decode
// rows that was ~5% of a bf16 step on the default model (docs/cpu.md). Here
// it is one pass per row. float32 rows keep torch's fused F.rms_norm.
#include <math.h>
#include <stdint.h>

#include "vec.h"

namespace {

using pagemill::bf16;
using pagemill::from_float;
using pagemill::to_float;

void norm_row(const bf16* x, const bf16* w, float eps, int64_t H, bf16* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t h = 0; h < H; ++h) ss += to_float(x[h]) * to_float(x[h]);
  const float r = 1.f / sqrtf(ss / (float)H + eps);
  for (int64_t h = 0; h < H; ++h) {
    const float normed = to_float(from_float<bf16>(to_float(x[h]) * r));
    out[h] = from_float<bf16>(to_float(w[h]) * normed);
  }
}

}  // namespace

extern "C" {

// x [rows, H] with row stride `stride`, out [rows, H] contiguous, w [H]; all bf16.
void pagemill_rms_norm_bf16(const bf16* x, int64_t rows, int64_t H, int64_t stride, const bf16* w, float eps,
                            bf16* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * H >= 32768)
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * stride, w, eps, H, out + r * H);
}
}
