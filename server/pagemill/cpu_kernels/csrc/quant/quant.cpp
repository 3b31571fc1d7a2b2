// The quant family's C entry points (cpu_kernels/quant.py): GGUF weights prepared once
// (repack.h), linears from them on int8 dot products (quant_gemm.h) or, for F32/F16/BF16
// rows, in float32 (float_rows.h), and rows read back as floats (embedding lookups,
// dequantize). Threads: the OpenMP team torch's libgomp already holds.
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "common/team_balance.h"
#include "common/vec.h"
#include "quant/canon.h"
#include "quant/float_rows.h"
#include "quant/quant_gemm.h"

namespace {

using namespace pagemill::quant;
using Bytes = pagemill::line_vector<uint8_t>;

constexpr int64_t kFloatColumnsL2 = 256 << 10;  // weight bytes a float-path column chunk keeps
constexpr int64_t kTeamQuantizes = 1 << 18;  // activations (M K) from which the team quantizes them

// The calling thread's scratch of at least n bytes (kept between calls: no allocation per call).
uint8_t* scratch(Bytes& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

bool valid(int type, int64_t N, int64_t K) { return N > 0 && row_bytes(type, K) > 0; }

// Float-type weights: y[m, n] for every m and n0 <= n < n1, in column chunks that stay in L2.
void float_range(int type, const uint8_t* w, int64_t K, const float* x, int64_t M, int64_t n0, int64_t n1, const Out& o) {
  const int64_t rb = row_bytes(type, K), cols = kFloatColumnsL2 / rb > 0 ? kFloatColumnsL2 / rb : 1;
  for (int64_t c0 = n0; c0 < n1; c0 += cols) {
    const int64_t c1 = c0 + cols < n1 ? c0 + cols : n1;
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int mr = (int)(M - m0 < kTileRows ? M - m0 : kTileRows);
      for (int64_t n = c0; n < c1; ++n) {
        float v[kTileRows];
        float_dots_any(type, w + n * rb, x + m0 * K, K, K, mr, v);
        for (int r = 0; r < mr; ++r) store_row(o, m0 + r, n, 1, &v[r]);
      }
    }
  }
}

void linear_float(int type, const uint8_t* w, int64_t N, int64_t K, const void* x, bool bf16, int64_t M, const Out& o,
                  int threads) {  // fmt: skip
  thread_local Bytes rows;
  const float* xf = (const float*)x;
  if (bf16) {  // widened once: every column reads every row
    float* t = (float*)scratch(rows, (size_t)(M * K * 4));
    for (int64_t i = 0; i < M * K; ++i) t[i] = bf16_to_float(((const uint16_t*)x)[i]);
    xf = t;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    float_range(type, w, K, xf, M, N * t / nt, N * (t + 1) / nt, o);
  }
}

void linear_quant(int type, const uint8_t* w, int64_t N, int64_t K, const void* x, bool bf16, int64_t M, const Out& o,
                  int threads) {  // fmt: skip
  thread_local Bytes buf;
  const int blk = acts_block(type);
  const int64_t acts = acts_bytes(M, K, blk), tail = kGroup * row_bytes(type, K);
  uint8_t* base = scratch(buf, (size_t)(acts + tail));
  const Acts a = acts_in(base, M, K, blk);
  Weight wt{type, w, N, K};
  pack_tail(wt, base + acts);
  // Quantizing is O(M K) against the product's O(M N K): the team shares it only where it is
  // long enough to pay for the barrier after it (a barrier is where a descheduled thread of a
  // busy machine costs the whole call).
  const bool team_quantizes = M * K >= kTeamQuantizes;
  if (!team_quantizes) {
    thread_local std::vector<float> tmp;
    if (bf16 && tmp.size() < (size_t)K) tmp.resize((size_t)K);
    for (int64_t m = 0; m < M; ++m) quantize_row(x, bf16, m, a, tmp.data());
  }
  pagemill::balance::TeamBalance* balance = pagemill::balance::begin_team(threads);
#pragma omp parallel num_threads(threads)
  {
    if (team_quantizes) {
      thread_local std::vector<float> tmp;
      if (bf16 && tmp.size() < (size_t)K) tmp.resize((size_t)K);
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) quantize_row(x, bf16, m, a, tmp.data());
    }
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const pagemill::balance::Busy busy(balance, t, nt);
    const int64_t span = kTileGroups * kGroup, units = (N + span - 1) / span;  // whole tiles of columns
    const int64_t u0 = pagemill::balance::bound(balance, units, t, nt);
    const int64_t u1 = pagemill::balance::bound(balance, units, t + 1, nt);
    gemm_range(wt, a, M, u0 * span, u1 * span < N ? u1 * span : N, o);
  }
  pagemill::balance::end_team(balance);
}

// Row n of a prepared weight as K floats.
void dequant_row(int type, const uint8_t* w, int64_t N, int64_t K, int64_t n, float* out) {
  const int64_t rb = row_bytes(type, K);
  if (is_float(type)) {
    for (int64_t k = 0; k < K; ++k) out[k] = float_at(type, w + n * rb, k);
    return;
  }
  const Layout l = layout(type);
  Canon c;
  for (int64_t b = 0; b < K / l.elems; ++b) {
    if (n < N / kGroup * kGroup)
      unpack_column(type, w + (n / kGroup) * kGroup * rb + b * group_block_bytes(type), (int)(n % kGroup), c);
    else  // a tail row, still as in the GGUF file
      from_gguf(type, w + n * rb + b * l.bytes, c);
    dequant(type, c, out + b * l.elems);
  }
}

}  // namespace

extern "C" {

// 2 where the kernels multiply with VNNI (vpdpbusd), 1 with AVX2, 0 on the portable loops.
int pagemill_quant_simd() {
#if defined(PAGEMILL_QUANT_VNNI)
  return 2;
#elif defined(PAGEMILL_QUANT_SIMD)
  return 1;
#else
  return 0;
#endif
}

int pagemill_quant_supported(int type) { return supported(type) ? 1 : 0; }

// Bytes of one row of K elements of `type`; 0 where K is not a whole number of its blocks.
int64_t pagemill_quant_row_bytes(int type, int64_t K) { return row_bytes(type, K); }

// src: the N GGUF rows of a weight -> dst: the same bytes in repack.h's layout (dst may be src;
// float types are copied as they are). Returns 0, or 1 on a bad type or shape.
int pagemill_quant_prepare(int type, const uint8_t* src, uint8_t* dst, int64_t N, int64_t K, int threads) {
  if (!valid(type, N, K)) return 1;
  const int64_t rb = row_bytes(type, K), groups = is_float(type) ? 0 : N / kGroup;
#pragma omp parallel num_threads(threads) if (groups > 1)
  {
    thread_local Bytes one;
    uint8_t* g = scratch(one, (size_t)(kGroup * rb));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < groups; ++i) {
      pack_group(type, src + i * kGroup * rb, rb, kGroup, K, g);  // via scratch: dst may be src
      memcpy(dst + i * kGroup * rb, g, (size_t)(kGroup * rb));
    }
  }
  if (dst != src) memcpy(dst + groups * kGroup * rb, src + groups * kGroup * rb, (size_t)((N - groups * kGroup) * rb));
  return 0;
}

// y[M, N] = x[M, K] @ W^T (+ bias[N], float32) with W prepared by pagemill_quant_prepare. x, y:
// float32 (x_bf16 = 0) or bfloat16 bits (1), rows contiguous. Returns 0, or 1 on a bad type or
// shape (nothing written).
int pagemill_quant_linear(int type, const uint8_t* w, int64_t N, int64_t K, const void* x, int x_bf16, int64_t M,
                          const float* bias, void* y, int threads) {  // fmt: skip
  if (!valid(type, N, K) || M < 0) return 1;
  if (M == 0) return 0;
  Out o;
  o.y = y;
  o.ld = N;
  o.bf16 = x_bf16 != 0;
  o.bias = bias;
  if (is_float(type))
    linear_float(type, w, N, K, x, x_bf16 != 0, M, o, threads);
  else
    linear_quant(type, w, N, K, x, x_bf16 != 0, M, o, threads);
  return 0;
}

// y[t] = row ids[t] of W as floats (ids null: row t, T = N: the whole matrix), float32 (y_bf16 =
// 0) or bfloat16 bits. Returns 0, 1 on a bad type or shape, 2 on an id outside [0, N).
int pagemill_quant_rows(int type, const uint8_t* w, int64_t N, int64_t K, const int64_t* ids, int64_t T, void* y,
                        int y_bf16, int threads) {  // fmt: skip
  if (!valid(type, N, K) || T < 0) return 1;
  for (int64_t t = 0; ids && t < T; ++t)
    if (ids[t] < 0 || ids[t] >= N) return 2;
#pragma omp parallel num_threads(threads) if (T * K >= (1 << 16))
  {
    thread_local std::vector<float> row;
    if (y_bf16 && row.size() < (size_t)K) row.resize((size_t)K);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* out = y_bf16 ? row.data() : (float*)y + t * K;
      dequant_row(type, w, N, K, ids ? ids[t] : t, out);
      if (y_bf16)
        for (int64_t k = 0; k < K; ++k) ((uint16_t*)y)[t * K + k] = float_to_bf16(out[k]);
    }
  }
  return 0;
}
}
