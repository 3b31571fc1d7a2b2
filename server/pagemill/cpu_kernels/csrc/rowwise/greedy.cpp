// Greedy next tokens: argmax and its log-probability per row of logits, in
// one pass to find the maximum and one to sum exp(x - max).
//
// Why: at 64 running greedy sequences the torch path (widen the bf16 logits
// to float32, logsumexp, argmax, gather) made three passes over 64 x 49152
// logits plus a 12.6 MB float32 copy, ~5% of a decode step (profile in
// docs/cpu.md). The logprob is the one Sampler reports for a greedy row:
// x[argmax] - logsumexp(x) = -log(sum_t exp(x_t - max)) in float32.
//
// The first maximum wins ties, as torch.argmax. A row with a NaN or an
// infinity is reported back (return value) and the caller takes the torch
// path, which defines those cases.
#include <math.h>
#include <stdint.h>

#include "common/simd_math.h"  // exp_nonpositive, first
#include "common/vec.h"

namespace {

using pagemill::bf16;

template <typename T>
bool greedy_row(const T* x, int64_t V, int64_t* id, float* logprob) {
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_i = _mm512_set1_epi32(0), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 bad = 0;
  for (int64_t t = 0; t < V; t += 16) {
    const __mmask16 k = pagemill::first(V - t);
    const __m512 v = _mm512_mask_blend_ps(k, _mm512_set1_ps(-INFINITY), pagemill::load16(x + t, V - t));
    bad |= _mm512_mask_cmp_ps_mask(k, _mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);  // NaN or inf
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly greater: earlier index kept
    best = _mm512_mask_blend_ps(gt, best, v);
    best_i = _mm512_mask_blend_epi32(gt, best_i, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (bad) return false;
  const float m = _mm512_reduce_max_ps(best);
  const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  *id = _mm512_mask_reduce_min_epi32(at, best_i);
  const __m512 mx = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < V; t += 16) {
    const __mmask16 k = pagemill::first(V - t);
    sum = _mm512_mask_add_ps(sum, k, sum, pagemill::exp_nonpositive(_mm512_sub_ps(pagemill::load16(x + t, V - t), mx)));
  }
  *logprob = -logf(_mm512_reduce_add_ps(sum));
  return true;
#else
  float m = -INFINITY;
  int64_t arg = 0;
  for (int64_t t = 0; t < V; ++t) {
    const float v = pagemill::to_float(x[t]);
    if (!isfinite(v)) return false;
    if (v > m) m = v, arg = t;
  }
  double sum = 0.0;
  for (int64_t t = 0; t < V; ++t) sum += expf(pagemill::to_float(x[t]) - m);
  *id = arg;
  *logprob = -(float)log(sum);
  return true;
#endif
}

}  // namespace

// Logits from which a call splits its rows over the team (6 rows of a 49152-token vocabulary).
constexpr int64_t kParallelFloats = 1 << 18;

extern "C" {

// logits [rows, V] row-major (row stride `stride` elements), float32 (bf16 == 0)
// or bfloat16. Returns 0, or 1 + a row holding a NaN or infinity (the last one).
int pagemill_greedy(const void* logits, int bf16_logits, int64_t rows, int64_t V, int64_t stride, int64_t* ids,
                    float* logprobs, int threads) {
  int failed = 0;
  // One thread below kParallelFloats: there the pass (~0.3 ns a logit) costs less than waking the
  // team. Above it the rows are split: at 32 rows of a 49152-token vocabulary one thread took
  // 0.48 ms (2026-12-06).
#pragma omp parallel for num_threads(threads) schedule(static) reduction(max : failed) if (rows * V >= kParallelFloats)
  for (int64_t r = 0; r < rows; ++r) {
    const bool ok = bf16_logits ? greedy_row((const bf16*)logits + r * stride, V, ids + r, logprobs + r)
                                : greedy_row((const float*)logits + r * stride, V, ids + r, logprobs + r);
    if (!ok && (int)(r + 1) > failed) failed = (int)(r + 1);
  }
  return failed;
}
}
