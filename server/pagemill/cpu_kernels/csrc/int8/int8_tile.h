// int8_rows.h's tiles: the call's arguments, the epilogue that turns a tile's exact int32 sums
// into outputs (store_sums: scales, bias, rounding) and the vpdpbusd register tiles; shared
// with int8_amx.h, whose AMX tiles end in the same epilogue.
#pragma once
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common/team_balance.h"
#include "common/vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagemill::int8 {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

constexpr int kBlock = 16;  // output channels per packed block
constexpr int kTileRows = 6;
constexpr int kTileBlocks = 4;

inline float bf16_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// v <- H v for each block of `b` (a power of two) floats, H the unnormalized
// Walsh-Hadamard matrix, by butterflies (quantized_linear.fwht_rows does the
// same additions in the same order, so the results agree to the bit).
#if defined(__AVX512F__)
// Stages h = 1, 2, 4, 8 inside each 16-float vector: lane j pairs with lane j ^ h; the lower of
// the two gets p + q, the upper q' - p' written as (partner - self), the same two operations.
inline __m512 butterfly_in_vector(__m512 v, int h) {
  const __m512i idx = _mm512_xor_si512(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                       _mm512_set1_epi32(h));
  const __m512 partner = _mm512_permutexvar_ps(idx, v);
  __mmask16 upper = 0;
  for (int j = 0; j < 16; ++j) upper |= (__mmask16)(((j & h) ? 1u : 0u) << j);
  return _mm512_mask_sub_ps(_mm512_add_ps(v, partner), upper, partner, v);
}
#endif

inline void fwht_blocks(float* v, int64_t K, int64_t b) {
#if defined(__AVX512F__)
  if (b % 16 == 0) {  // the same additions in the same order, 16 lanes at a time
    for (int64_t i = 0; i < K; i += 16) {
      __m512 x = _mm512_loadu_ps(v + i);
      for (int h = 1; h < 16; h *= 2) x = butterfly_in_vector(x, h);
      _mm512_storeu_ps(v + i, x);
    }
    for (int64_t base = 0; base < K; base += b)
      for (int64_t h = 16; h < b; h *= 2)
        for (int64_t i = base; i < base + b; i += 2 * h)
          for (int64_t j = i; j < i + h; j += 16) {
            const __m512 p = _mm512_loadu_ps(v + j), q = _mm512_loadu_ps(v + j + h);
            _mm512_storeu_ps(v + j, _mm512_add_ps(p, q));
            _mm512_storeu_ps(v + j + h, _mm512_sub_ps(p, q));
          }
    return;
  }
#endif
  for (int64_t base = 0; base < K; base += b)
    for (int64_t h = 1; h < b; h *= 2)
      for (int64_t i = base; i < base + b; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float p = v[j], q = v[j + h];
          v[j] = p + q;
          v[j + h] = p - q;
        }
}

#if defined(__AVX512F__)
// quantize_row's scaling and rounding, 16 at a time (the same operations per element).
inline float quantize_row_avx512(const float* xf, int64_t K, int64_t Kp, uint8_t* xu) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xf + k)));
  float amax = _mm512_reduce_max_ps(mx);
  for (int64_t k = 0; k < K; ++k)  // max_ps drops NaN: find one the way the scalar loop's test does
    if (xf[k] != xf[k]) amax = NAN;
  if (!(amax > 0.f) || !isfinite(amax)) {
    for (int64_t k = 0; k < Kp; ++k) xu[k] = 128;
    return amax > 0.f ? NAN : 0.f;
  }
  const __m512 inv = _mm512_set1_ps(127.f / amax), lim = _mm512_set1_ps(127.f);
  for (int64_t k = 0; k < K; k += 16) {
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xf + k), inv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
    const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(128));
    _mm_storeu_si128((__m128i*)(xu + k), _mm512_cvtepi32_epi8(u));
  }
  for (int64_t k = K; k < Kp; ++k) xu[k] = 128;
  return amax / 127.f;
}
#endif

// One row of activations -> xu (offset by 128, K padded to Kp with the
// offset, i.e. xq = 0) and its scale. Returns x_scale. rotate > 0: the row
// is first multiplied by the block Hadamard matrix (quantized_linear.py says
// why); tmp holds K floats.
inline float quantize_row(const void* x, bool bf16, int64_t K, int64_t Kp, int64_t rotate, uint8_t* xu, float* tmp) {
  const float* xf;
  if (bf16) {
    const uint16_t* h = (const uint16_t*)x;
    for (int64_t k = 0; k < K; ++k) tmp[k] = bf16_to_float(h[k]);
    xf = tmp;
  } else if (rotate > 0) {
    memcpy(tmp, x, (size_t)K * 4);
    xf = tmp;
  } else {
    xf = (const float*)x;
  }
  if (rotate > 0) fwht_blocks(tmp, K, rotate);
#if defined(__AVX512F__)
  if (K % 16 == 0) return quantize_row_avx512(xf, K, Kp, xu);
#endif
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = fmaxf(amax, fabsf(xf[k]));
  if (!(amax > 0.f) || !isfinite(amax)) {
    // All zero: every xq is 0. Inf/NaN input: there is no finite scale; the
    // output is NaN (scale NaN) rather than a silently wrong number.
    for (int64_t k = 0; k < Kp; ++k) xu[k] = 128;
    return amax > 0.f ? NAN : 0.f;
  }
  const float inv = 127.f / amax;
  for (int64_t k = 0; k < K; ++k) {
    float q = nearbyintf(xf[k] * inv);  // default rounding mode: half to even (torch.round)
    q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
    xu[k] = (uint8_t)((int)q + 128);
  }
  for (int64_t k = K; k < Kp; ++k) xu[k] = 128;
  return amax / 127.f;
}

struct Args {
  const uint8_t* xu;  // [M, Kp]
  const float* x_scale;  // [M]
  const int8_t* wq;  // packed [Np/16][Kp/4][16][4]
  const float* w_scale;  // [Np]
  const int32_t* w_corr;  // [Np]: 128 * sum_k wq[n, k]
  const float* bias;  // [N] or null
  void* y;  // [M, N], float32 or bf16
  bool bf16;
  int64_t M, N, Kp;
  bool add = false;  // float32 y only: y += the product (the fused layer's residual adds)
  balance::TeamBalance* balance = nullptr;  // the threads' shares of the blocks (null: even)
};

// y[m, n] = (acc - corr[n]) * (x_scale[m] * w_scale[n]) + bias[n], written
// for n < N only (the padded channels are dropped). fmaf so that the vector
// and portable paths round alike.
inline void store(const Args& a, int64_t m, int64_t n, float v) {
  if (n >= a.N) return;
  if (a.bf16)
    ((uint16_t*)a.y)[m * a.N + n] = float_to_bf16(v);
  else
    ((float*)a.y)[m * a.N + n] = a.add ? ((float*)a.y)[m * a.N + n] + v : v;
}

inline float epilogue(const Args& a, int64_t m, int64_t n, int32_t acc) {
  return fmaf((float)(acc - a.w_corr[n]), a.x_scale[m] * a.w_scale[n], a.bias && n < a.N ? a.bias[n] : 0.f);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The int32 sums of rows [m0, m0+mr) x blocks [b0, b0+nb) (row m, block j at
// sums[m * ld + j * 16]) through the epilogue, 16 outputs at a time.
inline void store_sums(const Args& a, int64_t m0, int mr, int64_t b0, int nb, const int32_t* sums, int64_t ld) {
  for (int j = 0; j < nb; ++j) {
    const int64_t n = (b0 + j) * kBlock;
    const int64_t valid = a.N - n < kBlock ? a.N - n : kBlock;
    const __mmask16 mask = valid >= kBlock ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
    const __m512i corr = _mm512_loadu_si512(a.w_corr + n);
    const __m512 ws = _mm512_loadu_ps(a.w_scale + n);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < mr; ++m) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(sums + m * ld + j * kBlock), corr));
      const __m512 r = _mm512_fmadd_ps(v, _mm512_mul_ps(_mm512_set1_ps(a.x_scale[m0 + m]), ws), bias);
      if (a.bf16) {  // narrowed 16 at a time (a scalar loop here cost as much as the products at 64 rows)
        _mm256_mask_storeu_epi16((uint16_t*)a.y + (m0 + m) * a.N + n, mask, pagemill::narrow_bf16(r));
      } else {
        float* y = (float*)a.y + (m0 + m) * a.N + n;
        _mm512_mask_storeu_ps(y, mask, a.add ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), r) : r);
      }
    }
  }
}

// Rows [m0, m0+MR) x blocks [b0, b0+NB). The accumulators must live in
// registers: GCC 12 keeps them on the stack (a store and a load around every
// vpdpbusd) unless the constant loops are unrolled early (the pragmas) and
// the epilogue reads the sums back from memory rather than from the array.
template <int MR, int NB>
void tile(const Args& a, int64_t m0, int64_t b0) {
  __m512i acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_si512();
  const int64_t k4s = a.Kp / 4, block_bytes = a.Kp * kBlock;
  const int8_t* w = a.wq + b0 * block_bytes;
  const uint8_t* x = a.xu + m0 * a.Kp;
  for (int64_t k4 = 0; k4 < k4s; ++k4) {
    __m512i wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      ask_ahead(w + j * block_bytes + k4 * 64);  // vec.h: the L2 streamer alone lags at few rows
      wv[j] = _mm512_loadu_si512(w + j * block_bytes + k4 * 64);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      int32_t four;
      memcpy(&four, x + m * a.Kp + 4 * k4, 4);
      const __m512i xb = _mm512_set1_epi32(four);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], xb, wv[j]);
    }
  }
  alignas(64) int32_t sums[MR][NB][kBlock];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) _mm512_store_si512(sums[m][j], acc[m][j]);
  store_sums(a, m0, MR, b0, NB, &sums[0][0][0], NB * kBlock);
}

template <int MR>
void tile_blocks(const Args& a, int64_t m0, int64_t b0, int nb) {
  switch (nb) {
    case 4: tile<MR, 4>(a, m0, b0); break;
    case 3: tile<MR, 3>(a, m0, b0); break;
    case 2: tile<MR, 2>(a, m0, b0); break;
    default: tile<MR, 1>(a, m0, b0); break;
  }
}

inline void tile_any(const Args& a, int64_t m0, int mr, int64_t b0, int nb) {
  switch (mr) {
    case 6: tile_blocks<6>(a, m0, b0, nb); break;
    case 5: tile_blocks<5>(a, m0, b0, nb); break;
    case 4: tile_blocks<4>(a, m0, b0, nb); break;
    case 3: tile_blocks<3>(a, m0, b0, nb); break;
    case 2: tile_blocks<2>(a, m0, b0, nb); break;
    default: tile_blocks<1>(a, m0, b0, nb); break;
  }
}
#else
// Portable: the same sums, one row and one block at a time.
inline void tile_any(const Args& a, int64_t m0, int mr, int64_t b0, int nb) {
  const int64_t k4s = a.Kp / 4, block_bytes = a.Kp * kBlock;
  for (int64_t b = b0; b < b0 + nb; ++b) {
    const int8_t* w = a.wq + b * block_bytes;
    for (int64_t m = m0; m < m0 + mr; ++m) {
      const uint8_t* x = a.xu + m * a.Kp;
      int32_t acc[kBlock] = {0};
      for (int64_t k4 = 0; k4 < k4s; ++k4)
        for (int j = 0; j < kBlock; ++j)
          for (int i = 0; i < 4; ++i) acc[j] += (int32_t)x[4 * k4 + i] * (int32_t)w[k4 * 64 + j * 4 + i];
      for (int j = 0; j < kBlock; ++j) store(a, m, b * kBlock + j, epilogue(a, m, b * kBlock + j, acc[j]));
    }
  }
}
#endif

}  // namespace pagemill::int8
