// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) with every element summed in one fixed order
// (common/fixed_order.h), for --batch-invariant.
//
// Why not the library GEMMs or matvec.cpp: they pick blocking, micro-kernels and how K is
// split from the number of rows, so one row's sums come out in a different order at 1 row
// than at 64, and a bfloat16 greedy answer moves with what shares the step. Here register
// tiles of up to 3 rows x 4 weight rows run the same lane-wise fused multiply-adds per
// element as a 1 x 1 tile would; blocking and the split of weight rows over threads only
// change which elements are computed together. K is never split.
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "common/fixed_order.h"
#include "common/vec.h"

namespace {

using pagemill::bf16;
namespace fx = pagemill::fixed;

constexpr int kTileRows = 3;  // 3 x 4 accumulators + 3 inputs + 1 weight: the 16 vector registers
constexpr int kTileCols = 4;
constexpr int64_t kRowBlock = 48;  // input rows a task keeps hot while it walks its weight rows
constexpr int64_t kColBlock = 64;  // weight rows of a task (~100-400 KB at these K: L2)
// Below this many multiply-adds one thread does it all: the split would not change a bit, but
// on a busy machine each parallel region's barrier waits for a descheduled thread (measured at
// batch 1 on the default model, 2 threads at load 5: 233 ms of linears per step against 55 on
// one thread), and a decode step's small linears gain little from a second core.
constexpr int64_t kParallelWork = int64_t(1) << 22;

// R x C outputs; x rows are float32 padded with zeros to Kp (a multiple of 8).
template <int R, int C, class W>
inline void tile(const float* x, int64_t Kp, const W* w, int64_t K, float out[kTileRows][kTileCols]) {
  fx::Lanes acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = fx::zero();
  int64_t k = 0;
  for (; k + fx::kLanes <= K; k += fx::kLanes) {
    fx::Lanes xv[R];
    for (int r = 0; r < R; ++r) xv[r] = fx::load(x + r * Kp + k);
    for (int c = 0; c < C; ++c) {
      const fx::Lanes wv = fx::load(w + c * K + k);
      for (int r = 0; r < R; ++r) acc[r][c] = fx::fma(xv[r], wv, acc[r][c]);
    }
  }
  if (k < K) {  // the tail: x's padding is zeros, w's is read as zeros
    for (int c = 0; c < C; ++c) {
      const fx::Lanes wv = fx::load_tail(w + c * K + k, K - k);
      for (int r = 0; r < R; ++r) acc[r][c] = fx::fma(fx::load(x + r * Kp + k), wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = fx::sum(acc[r][c]);
}

template <int R, class W>
inline void tile_rows(int cols, const float* x, int64_t Kp, const W* w, int64_t K, float out[kTileRows][kTileCols]) {
  switch (cols) {
    case 1: tile<R, 1>(x, Kp, w, K, out); break;
    case 2: tile<R, 2>(x, Kp, w, K, out); break;
    case 3: tile<R, 3>(x, Kp, w, K, out); break;
    default: tile<R, 4>(x, Kp, w, K, out); break;
  }
}

template <class W>
inline void any_tile(int rows, int cols, const float* x, int64_t Kp, const W* w, int64_t K,
                     float out[kTileRows][kTileCols]) {
  switch (rows) {
    case 1: tile_rows<1>(cols, x, Kp, w, K, out); break;
    case 2: tile_rows<2>(cols, x, Kp, w, K, out); break;
    default: tile_rows<3>(cols, x, Kp, w, K, out); break;
  }
}

template <class T>
void run(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t Kp = (K + fx::kLanes - 1) / fx::kLanes * fx::kLanes;
  static thread_local std::vector<float> buf;
  buf.assign(M * Kp, 0.f);  // exact: bf16 -> float adds no rounding
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) buf[m * Kp + k] = pagemill::to_float(x[m * K + k]);
  const float* xf = buf.data();
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock, col_blocks = (N + kColBlock - 1) / kColBlock;
  if (M * N * K < kParallelWork) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < row_blocks * col_blocks; ++task) {
    const int64_t m0 = task / col_blocks * kRowBlock, m1 = std::min(M, m0 + kRowBlock);
    const int64_t n0 = task % col_blocks * kColBlock, n1 = std::min(N, n0 + kColBlock);
    for (int64_t n = n0; n < n1; n += kTileCols) {
      const int cols = (int)std::min<int64_t>(kTileCols, n1 - n);
      for (int64_t m = m0; m < m1; m += kTileRows) {
        const int rows = (int)std::min<int64_t>(kTileRows, m1 - m);
        float out[kTileRows][kTileCols];
        any_tile(rows, cols, xf + m * Kp, Kp, w + n * K, K, out);
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < cols; ++c) {
            const float b = bias ? pagemill::to_float(bias[n + c]) : 0.f;
            y[(m + r) * N + n + c] = pagemill::from_float<T>(out[r][c] + b);
          }
      }
    }
  }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (x, w, bias and y alike). Returns 0, or 1 for an unknown dtype.
int pagemill_invariant_linear(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t N,
                              int64_t K, int dtype, int threads) {
  if (dtype == 0) {
    run((const float*)x, (const float*)w, (const float*)bias, (float*)y, M, N, K, threads);
  } else if (dtype == 1) {
    run((const bf16*)x, (const bf16*)w, (const bf16*)bias, (bf16*)y, M, N, K, threads);
  } else {
    return 1;
  }
  return 0;
}
}
