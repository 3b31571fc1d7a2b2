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
#include <stdint.h>

#include "common/bf16_row_ops.h"  // silu_mul_row, rotary_head (shared with decode_batched.cpp)

using pagemill::bf16;
using pagemill::rows::rotary_head;
using pagemill::rows::silu_mul_row;

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
