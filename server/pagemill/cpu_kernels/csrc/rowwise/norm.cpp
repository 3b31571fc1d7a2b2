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
#include <stdint.h>

#include "common/bf16_row_ops.h"  // norm_row, add_norm_row (the arithmetic, shared with decode_batched.cpp)

using pagemill::bf16;
using pagemill::rows::add_norm_row;
using pagemill::rows::norm_row;

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
