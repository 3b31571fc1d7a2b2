// Dot products of a few float activation rows against one bfloat16 weight
// row: the inner loop of every bf16 linear in decode (matvec.cpp, decode.cpp).
//
// Two ways to multiply, chosen by batch rows (choose_mul, measured):
// - kDpbf16: AVX512-BF16's vdpbf16ps multiplies 32 bf16 pairs into 16 float
//   sums per instruction. The activations are rounded to bf16 once per
//   linear, as torch's bf16 linear holds them anyway.
// - kWiden: a bf16 is the upper half of a float32, so 32 weights become two
//   float vectors with one shift (even elements) and one mask (odd ones),
//   FMA'd against activations stored split the same way (per 32: the 16
//   even, then the 16 odd). No shuffles; activations stay float32.
// Without AVX-512 a scalar loop reads the kWiden layout (the fallback the
// tests build with -mno-avx512f).
//
// Activations are prepared once per linear (prepare) into rows padded with
// zeros to a multiple of 32, so the weight row is the only masked load.
#pragma once
#include <stdint.h>

#include "common/vec.h"

namespace pagemill {

enum class Bf16Mul : int { kDpbf16 = 0, kWiden = 1 };

// What the kernels use for M rows when the caller does not say. Measured
// (benchmarks/bf16_ab.py, all decode linears of the default model, docs/cpu.md):
// from 2 rows vdpbf16ps is 1.3-2x faster than widening; at 1 row the two
// measured within the machine's noise of each other, and vdpbf16ps issues
// under half the instructions per weight byte (3 against 7 per 64 bytes),
// which is what counts when the core is shared.
inline Bf16Mul choose_mul(int64_t M) {
  (void)M;
#if defined(__AVX512BF16__)
  return Bf16Mul::kDpbf16;
#else
  return Bf16Mul::kWiden;
#endif
}

// A request the build cannot honour falls back to the multiply it has.
inline Bf16Mul usable(Bf16Mul mul) {
#if defined(__AVX512BF16__)
  return mul;
#else
  (void)mul;
  return Bf16Mul::kWiden;
#endif
}

inline int64_t padded32(int64_t K) { return (K + 31) / 32 * 32; }
// Scratch bytes prepare() needs for M rows of K.
inline int64_t prepared_bytes(int64_t M, int64_t K) { return M * padded32(K) * (int64_t)sizeof(float); }

struct Bf16Rows {
  const void* data;  // bf16 (kDpbf16) or float (kWiden) rows, `stride` elements apart
  int64_t stride;
  Bf16Mul mul;
};

// x [M, K] (float or bf16, row-major) -> rows in `mul`'s layout in buf.
template <typename X>
inline Bf16Rows prepare(const X* x, int64_t M, int64_t K, Bf16Mul mul, void* buf) {
  const int64_t Kp = padded32(K);
  for (int64_t m = 0; m < M; ++m) {
    const X* xm = x + m * K;
    if (mul == Bf16Mul::kDpbf16) {
      bf16* o = static_cast<bf16*>(buf) + m * Kp;
      for (int64_t k = 0; k < Kp; ++k) o[k] = k < K ? from_float<bf16>(to_float(xm[k])) : bf16{0};
    } else {
      float* o = static_cast<float*>(buf) + m * Kp;
      for (int64_t c = 0; c < Kp; c += 32) {
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t e = c + 2 * i, odd = e + 1;
          o[c + i] = e < K ? to_float(xm[e]) : 0.f;
          o[c + 16 + i] = odd < K ? to_float(xm[odd]) : 0.f;
        }
      }
    }
  }
  return Bf16Rows{buf, Kp, mul};
}

// out[m] = x[m] . w over K for the M prepared rows.
template <int M>
inline void rows_dot(const Bf16Rows& x, const bf16* w, int64_t K, float* out) {
  const int64_t Kp = x.stride;
#if defined(__AVX512F__)
  __m512 a[M], b[M];  // two chains per row: even and odd 32-blocks (dpbf16) or elements (widen)
  for (int m = 0; m < M; ++m) a[m] = b[m] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if (x.mul == Bf16Mul::kDpbf16) {
    const bf16* xb = static_cast<const bf16*>(x.data);
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      ask_ahead(w + k);  // vec.h: the next lines of this thread's stream
      ask_ahead(w + k + 32);
      const __m512bh u = (__m512bh)_mm512_loadu_si512(w + k), v = (__m512bh)_mm512_loadu_si512(w + k + 32);
      for (int m = 0; m < M; ++m) {
        a[m] = _mm512_dpbf16_ps(a[m], u, (__m512bh)_mm512_loadu_si512(xb + m * Kp + k));
        b[m] = _mm512_dpbf16_ps(b[m], v, (__m512bh)_mm512_loadu_si512(xb + m * Kp + k + 32));
      }
    }
    for (; k < K; k += 32) {
      ask_ahead(w + k);
      const __mmask32 t = K - k >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (K - k)) - 1);
      const __m512bh u = (__m512bh)_mm512_maskz_loadu_epi16(t, w + k);
      for (int m = 0; m < M; ++m) a[m] = _mm512_dpbf16_ps(a[m], u, (__m512bh)_mm512_loadu_si512(xb + m * Kp + k));
    }
    for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
    return;
  }
#endif
  const float* xf = static_cast<const float*>(x.data);
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int64_t k = 0; k < K; k += 32) {
    ask_ahead(w + k);
    const __mmask32 t = K - k >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (K - k)) - 1);
    const __m512i raw = _mm512_maskz_loadu_epi16(t, w + k);
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    for (int m = 0; m < M; ++m) {
      a[m] = _mm512_fmadd_ps(even, _mm512_loadu_ps(xf + m * Kp + k), a[m]);
      b[m] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(xf + m * Kp + k + 16), b[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
#else
  const float* xf = static_cast<const float*>(x.data);  // kWiden layout (usable() guarantees it)
  for (int m = 0; m < M; ++m) {
    const float* xm = xf + m * Kp;
    float s = 0.f;
    for (int64_t c = 0; c < K; c += 32) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t e = c + 2 * i;
        if (e < K) s += to_float(w[e]) * xm[c + i];
        if (e + 1 < K) s += to_float(w[e + 1]) * xm[c + 16 + i];
      }
    }
    out[m] = s;
  }
#endif
}

}  // namespace pagemill
