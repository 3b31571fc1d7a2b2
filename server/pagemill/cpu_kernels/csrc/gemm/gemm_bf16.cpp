// y[M, N] = x[M, K] @ w[N, K]^T (+ bias) in bfloat16 over the packed weight
// layout of gemm_bf16.h (wrapped by gemm.py, used by models/packed_linear.py).
#include <omp.h>
#include <stdint.h>

#include "gemm/gemm_bf16.h"

namespace {

void run(pagemill::gemm::Args a, int threads) {
  // A team only pays when there is more than a block per thread.
  const int64_t blocks = (a.N + pagemill::gemm::kBlock - 1) / pagemill::gemm::kBlock;
  const int nt = blocks < 2 * threads ? 1 : threads;
  // The team's shares, adapted call by call (team_balance.h says why).
  a.balance = pagemill::balance::begin_team(nt);
#pragma omp parallel num_threads(nt)
  pagemill::gemm::share(a, omp_get_thread_num(), omp_get_num_threads());
  pagemill::balance::end_team(a.balance);
}

}  // namespace

extern "C" {

// 1 where the AVX512-BF16 path was compiled in, 0 for the portable loop.
int pagemill_gemm_bf16_fast() { return pagemill::gemm::kDpbf16 ? 1 : 0; }

// 1 where calls of 4+ rows run on AMX tiles (compiled in, and Linux granted them), else 0.
int pagemill_gemm_bf16_amx() { return pagemill::gemm::kAmxBuilt && pagemill::amx::permitted() ? 1 : 0; }

// x [M, K] bf16 rows ldx elements apart (K even); w packed [ceil(N/16)][K/2][16][2];
// bias bf16 [N] or null; y [M, N] bf16 rows ldy apart. Returns 0, or 1 on a bad
// shape (nothing written).
int pagemill_gemm_bf16(const pagemill::bf16* x, int64_t ldx, const pagemill::bf16* w, const pagemill::bf16* bias,
                       pagemill::bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
  if (M < 0 || N <= 0 || K <= 0 || K % 2 != 0 || ldx < K || ldy < N) return 1;
  if (M == 0) return 0;
  run(pagemill::gemm::Args{x, ldx, w, bias, y, ldy, M, N, K}, threads);
  return 0;
}

// y [M, N/2] = silu(gate) * up of an MLP's gate_up weight packed with interleaved blocks
// (gemm_bf16.h, gemm.py's pack_swiglu; bias interleaved the same way, or null); N % 32 == 0.
// Returns 0, 1 on a bad shape, 2 where the build has no AVX512-BF16 (nothing written).
int pagemill_gemm_bf16_swiglu(const pagemill::bf16* x, int64_t ldx, const pagemill::bf16* w,
                              const pagemill::bf16* bias, pagemill::bf16* y, int64_t ldy, int64_t M, int64_t N,
                              int64_t K, int threads) {
  if (M < 0 || N <= 0 || N % 32 != 0 || K <= 0 || K % 2 != 0 || ldx < K || ldy < N / 2) return 1;
  if (!pagemill::gemm::kDpbf16) return 2;
  if (M == 0) return 0;
  pagemill::gemm::Args a{x, ldx, w, bias, y, ldy, M, N, K};
  a.swiglu = true;
  run(a, threads);
  return 0;
}

// Tests (tests/test_gemm_bf16.py): the linear (swiglu != 0: the SwiGLU one) on a team of
// `threads` whose shares are cum [threads + 1] (0 .. 1, rising) instead of the adapted ones.
// Returns 0, 1 on a bad shape or bad shares.
int pagemill_gemm_bf16_shares(const pagemill::bf16* x, int64_t ldx, const pagemill::bf16* w,
                              const pagemill::bf16* bias, pagemill::bf16* y, int64_t ldy, int64_t M, int64_t N,
                              int64_t K, int swiglu, const double* cum, int threads) {
  if (M < 1 || N <= 0 || K <= 0 || K % 2 || ldx < K || threads < 2 || threads > pagemill::balance::kMaxThreads)
    return 1;
  if (swiglu && (N % 32 || ldy < N / 2 || !pagemill::gemm::kDpbf16)) return 1;
  if (!swiglu && ldy < N) return 1;
  if (cum[0] != 0 || cum[threads] != 1) return 1;
  for (int t = 0; t < threads; ++t)
    if (cum[t + 1] < cum[t]) return 1;
  pagemill::balance::TeamBalance balance;
  balance.begin(threads);
  for (int t = 0; t <= threads; ++t) balance.cum[t] = cum[t];
  pagemill::gemm::Args a{x, ldx, w, bias, y, ldy, M, N, K};
  a.swiglu = swiglu != 0;
  a.balance = &balance;
#pragma omp parallel num_threads(threads)
  pagemill::gemm::share(a, omp_get_thread_num(), omp_get_num_threads());
  return 0;
}

// Tests: one TeamBalance::update of a team of `threads` with shares cum [threads + 1] after the
// threads spent busy [threads] seconds; the new shares are written back to cum.
void pagemill_team_balance_update(int threads, double* cum, const double* busy) {
  pagemill::balance::TeamBalance balance;
  balance.begin(threads);
  for (int t = 0; t <= threads && t <= pagemill::balance::kMaxThreads; ++t) balance.cum[t] = cum[t];
  for (int t = 0; t < threads && t < pagemill::balance::kMaxThreads; ++t) balance.busy[t] = busy[t];
  balance.update();
  for (int t = 0; t <= balance.nt; ++t) cum[t] = balance.cum[t];
}
}
