// y[M, N] = x[M, K] @ w[N, K]^T (+ bias) with int8 weights and int8 activations
// (--quantize int8), one linear per call. The arithmetic, the packed layout
// and the micro-kernel are in int8_rows.h (shared with decode.cpp's fused
// layer).
#include <omp.h>
#include <stdint.h>

#include <vector>

#include "int8/int8_rows.h"
#include "common/team_balance.h"

namespace {

using namespace pagemill::int8;

void run(Args a, int threads) {
  // The team's shares, adapted call by call (team_balance.h says why).
  a.balance = pagemill::balance::begin_team(threads);
#pragma omp parallel num_threads(threads)
  share(a, omp_get_thread_num(), omp_get_num_threads());
  pagemill::balance::end_team(a.balance);
}

}  // namespace

extern "C" {

// 1 where the AVX512-VNNI path was compiled in, 0 for the portable loop.
int pagemill_int8_vnni() { return kVnni ? 1 : 0; }

// 1 where calls of 8+ rows (K padded to a multiple of 64) run on AMX-INT8 tiles: compiled in and
// granted by the OS; else 0.
int pagemill_int8_amx() { return kAmxBuilt && pagemill::amx::permitted() ? 1 : 0; }

// x [M, K] float32 (x_bf16 = 0) or bfloat16 (1), rows contiguous; y [M, N]
// of the same dtype. wq/w_scale/w_corr as packed by
// models/quantized_linear.py (N padded to a multiple of 16, K to 4); bias
// float32 [N] or null. rotate: 0, or the Hadamard block size (a power of
// two dividing K) the weights were rotated with. Returns 0, or 1 on a bad
// shape (nothing written).
int pagemill_int8_linear(const void* x, int x_bf16, const int8_t* wq, const float* w_scale, const int32_t* w_corr,
                         const float* bias, void* y, int64_t M, int64_t N, int64_t K, int64_t rotate, int threads) {
  if (M < 0 || N <= 0 || K <= 0) return 1;
  if (rotate < 0 || (rotate > 0 && ((rotate & (rotate - 1)) != 0 || K % rotate != 0))) return 1;
  if (M == 0) return 0;
  const int64_t Kp = (K + 3) / 4 * 4;
  pagemill::line_vector<uint8_t> xu((size_t)(M * Kp));  // rows the AMX tiles load
  std::vector<float> x_scale((size_t)M);
  const int64_t elem = x_bf16 ? 2 : 4;
  // Quantizing is O(M K) against the product's O(M N K): parallel only when
  // there are enough rows to pay for waking the team.
#pragma omp parallel num_threads(threads) if (M >= 8)
  {
    std::vector<float> tmp(x_bf16 || rotate > 0 ? (size_t)K : 0);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
      x_scale[m] = quantize_row((const char*)x + m * K * elem, x_bf16 != 0, K, Kp, rotate, xu.data() + m * Kp,
                                 tmp.data());
  }
  const Args a{xu.data(), x_scale.data(), wq, w_scale, w_corr, bias, y, x_bf16 != 0, M, N, Kp};
  run(a, threads);
  return 0;
}
}
