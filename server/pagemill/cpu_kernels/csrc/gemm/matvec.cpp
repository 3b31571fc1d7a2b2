// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for a few rows M (decode), float32
// or bfloat16 (float32 sums, see bf16_rows.h), row-major.
//
// Why a kernel of our own: at M = 1..2 a decode step is a pure stream over
// the weights, and neither of torch's CPU paths streams at memory speed
// (MKL sgemv ~9 GB/s, oneDNN's packed inner product ~17 GB/s where a plain
// sum reads ~29 GB/s on the reference machine). This reads each weight row
// once, straight from its natural layout (no packed copy), two rows at a time
// per thread with the M input rows held in L1, and splits rows statically so
// that each thread streams one contiguous half of the matrix.
//
// Built at runtime with -march=native (cpu_kernels/build.py); linked to
// the libgomp torch already loaded, so it shares torch's OpenMP thread pool.
#include <stdint.h>

#include <vector>

#include "common/bf16_rows.h"
#include "common/vec.h"

namespace {

constexpr int kMaxRows = 8;

#if defined(__AVX512F__)
template <int M>
inline void two_rows(const float* x, const float* w0, const float* w1, int64_t K, float* out0, float* out1) {
  __m512 a[M], b[M];
  for (int m = 0; m < M; ++m) a[m] = b[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    pagemill::ask_ahead(w0 + k);
    pagemill::ask_ahead(w1 + k);
    const __m512 u = _mm512_loadu_ps(w0 + k), v = _mm512_loadu_ps(w1 + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xm = _mm512_loadu_ps(x + m * K + k);
      a[m] = _mm512_fmadd_ps(u, xm, a[m]);
      b[m] = _mm512_fmadd_ps(v, xm, b[m]);
    }
  }
  if (k < K) {  // masked tail: K need not be a multiple of 16
    const __mmask16 t = (__mmask16)((1u << (K - k)) - 1);
    const __m512 u = _mm512_maskz_loadu_ps(t, w0 + k), v = _mm512_maskz_loadu_ps(t, w1 + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xm = _mm512_maskz_loadu_ps(t, x + m * K + k);
      a[m] = _mm512_fmadd_ps(u, xm, a[m]);
      b[m] = _mm512_fmadd_ps(v, xm, b[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    out0[m] = _mm512_reduce_add_ps(a[m]);
    out1[m] = _mm512_reduce_add_ps(b[m]);
  }
}
#else
template <int M>
inline void two_rows(const float* x, const float* w0, const float* w1, int64_t K, float* out0, float* out1) {
  for (int m = 0; m < M; ++m) {
    float s0 = 0.f, s1 = 0.f;
    const float* xm = x + m * K;
#pragma omp simd reduction(+ : s0, s1)
    for (int64_t k = 0; k < K; ++k) {
      s0 += w0[k] * xm[k];
      s1 += w1[k] * xm[k];
    }
    out0[m] = s0;
    out1[m] = s1;
  }
}
#endif

// One input row: each weight row in turn (pagemill::dot, two FMA chains).
// Measured faster than interleaving two rows.
void run_one(const float* x, const float* w, const float* bias, float* y, int64_t N, int64_t K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; ++n) y[n] = pagemill::dot<true>(w + n * K, x, K) + (bias ? bias[n] : 0.f);
}

template <int M>
void run(const float* x, const float* w, const float* bias, float* y, int64_t N, int64_t K, int threads) {
  const int64_t pairs = (N + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t n0 = 2 * p, n1 = n0 + 1 < N ? n0 + 1 : n0;  // odd N: the last row twice
    float r0[M], r1[M];
    two_rows<M>(x, w + n0 * K, w + n1 * K, K, r0, r1);
    for (int m = 0; m < M; ++m) {
      y[m * N + n0] = r0[m] + (bias ? bias[n0] : 0.f);
      y[m * N + n1] = r1[m] + (bias ? bias[n1] : 0.f);
    }
  }
}

// bfloat16: x prepared once (bf16_rows.h), then each thread streams its
// contiguous share of weight rows against all M rows.
template <int M>
void run_bf16(const pagemill::Bf16Rows& x, const pagemill::bf16* w, const pagemill::bf16* bias, pagemill::bf16* y,
              int64_t N, int64_t K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; ++n) {
    float r[M];
    pagemill::rows_dot<M>(x, w + n * K, K, r);
    const float b = bias ? pagemill::to_float(bias[n]) : 0.f;
    for (int m = 0; m < M; ++m) y[m * N + n] = pagemill::from_float<pagemill::bf16>(r[m] + b);
  }
}

}  // namespace

extern "C" {

int pagemill_matvec_max_rows() { return kMaxRows; }

// Returns 0, or 1 when M is outside 1..kMaxRows (nothing written).
int pagemill_matvec(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                    int threads) {
  switch (M) {
    case 1: run_one(x, w, bias, y, N, K, threads); return 0;
    case 2: run<2>(x, w, bias, y, N, K, threads); return 0;
    case 3: run<3>(x, w, bias, y, N, K, threads); return 0;
    case 4: run<4>(x, w, bias, y, N, K, threads); return 0;
    case 5: run<5>(x, w, bias, y, N, K, threads); return 0;
    case 6: run<6>(x, w, bias, y, N, K, threads); return 0;
    case 7: run<7>(x, w, bias, y, N, K, threads); return 0;
    case 8: run<8>(x, w, bias, y, N, K, threads); return 0;
    default: return 1;
  }
}

// bfloat16 x, w, bias and y; mul: -1 for the measured default, else a
// pagemill::Bf16Mul (benchmarks compare them). Returns 0, or 1 when M is
// outside 1..kMaxRows (nothing written).
int pagemill_matvec_bf16(const pagemill::bf16* x, const pagemill::bf16* w, const pagemill::bf16* bias,
                         pagemill::bf16* y, int64_t M, int64_t N, int64_t K, int threads, int mul) {
  using namespace pagemill;
  if (M < 1 || M > kMaxRows) return 1;
  static thread_local std::vector<float> buf;
  buf.resize(prepared_bytes(M, K) / sizeof(float));
  const Bf16Rows xr = prepare(x, M, K, usable(mul < 0 ? choose_mul(M) : (Bf16Mul)mul), buf.data());
  switch (M) {
    case 1: run_bf16<1>(xr, w, bias, y, N, K, threads); break;
    case 2: run_bf16<2>(xr, w, bias, y, N, K, threads); break;
    case 3: run_bf16<3>(xr, w, bias, y, N, K, threads); break;
    case 4: run_bf16<4>(xr, w, bias, y, N, K, threads); break;
    case 5: run_bf16<5>(xr, w, bias, y, N, K, threads); break;
    case 6: run_bf16<6>(xr, w, bias, y, N, K, threads); break;
    case 7: run_bf16<7>(xr, w, bias, y, N, K, threads); break;
    case 8: run_bf16<8>(xr, w, bias, y, N, K, threads); break;
  }
  return 0;
}
}
