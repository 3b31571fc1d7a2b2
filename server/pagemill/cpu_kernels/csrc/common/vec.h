// Inner loops shared by the CPU kernels: the element types (float32 and
// bfloat16) and dot products of float activations against either.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <new>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagemill {

// Memory on 64-byte cache lines: scratch an AMX tile loads 64-byte rows from (glibc's malloc
// gives 16-byte boundaries, where every such row straddles two lines: a 2044-token prefill
// step of the batched layer took 1.06x, docs/cpu.md).
template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    void* p = aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return (T*)p;
  }
  void deallocate(T* p, size_t) { free(p); }
  template <class U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <class T>
using line_vector = std::vector<T, LineAllocator<T>>;

#if defined(__AVX512F__)
// How far ahead of its loads a decode linear's weight walk asks for lines (prefetcht0): each
// thread walks its contiguous share of a weight, so the line 1 KB on is in the same stream.
// Measured (the default model's 56 MB output head at batch 1 through matvec.cpp, 2 threads,
// a ring of 6 copies in huge pages): 2.38 ms without, 1.75-1.85 ms with 512 B to 3 KB ahead,
// against 1.69-1.72 ms for a plain read of the same bytes. The L2 streamer alone, which starts
// over at every 4 KiB page, kept ~24 of the ~33 GB/s the two cores read.
constexpr int64_t kWeightAhead = 1024;

inline void ask_ahead(const void* w) { _mm_prefetch((const char*)w + kWeightAhead, _MM_HINT_T0); }
#endif

// bfloat16 as its raw bits (the upper half of a float32); a struct so that it
// never converts to or from an integer by accident.
struct bf16 {
  uint16_t bits;
};

// fp8 KV cache entries (--kv-cache-dtype, attention/kv_dtype.py), read only:
// e4m3fn (bias 7, no infinities) and e5m2 (the top byte of an IEEE half).
// Stored with a saturating cast, so never NaN or infinite here.
struct fp8e4m3 {
  uint8_t bits;
};
struct fp8e5m2 {
  uint8_t bits;
};

inline float to_float(float v) { return v; }
// e4m3 -> float: exponent and mantissa moved into float32's fields as they
// are, then scaled by 2^(127 - 7); the scaling also turns e4m3's subnormals
// (exponent 0) into the right values, from float32's own subnormals.
inline float to_float(fp8e4m3 v) {
  const uint32_t u = ((uint32_t)(v.bits & 0x7f) << 20) | ((uint32_t)(v.bits & 0x80) << 24);
  float f;
  memcpy(&f, &u, 4);
  return f * 0x1p120f;
}
// e5m2 -> float the same way: 2^(127 - 15).
inline float to_float(fp8e5m2 v) {
  const uint32_t u = ((uint32_t)(v.bits & 0x7f) << 21) | ((uint32_t)(v.bits & 0x80) << 24);
  float f;
  memcpy(&f, &u, 4);
  return f * 0x1p112f;
}
inline float to_float(bf16 v) {
  const uint32_t u = (uint32_t)v.bits << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// float -> T, rounding to nearest even as torch's .to(torch.bfloat16) does.
template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) {
  return f;
}
template <>
inline bf16 from_float<bf16>(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{(uint16_t)((u >> 16) | 0x40)};  // NaN stays a (quiet) NaN
  return bf16{(uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

// sum_k a[k] * b[k]. Two accumulators over 32 floats: two independent FMA
// chains keep both FMA ports busy while the loads stream. kAhead: a is a weight
// row of a decode linear's stream, its lines asked for ahead (ask_ahead).
template <bool kAhead = false>
inline float dot(const float* a, const float* b, int64_t K) {
#if defined(__AVX512F__)
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if constexpr (kAhead) {
      ask_ahead(a + k);
      ask_ahead(a + k + 16);
    }
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(b + k + 16), s1);
  }
  for (; k < K; k += 16) {  // masked tail: K need not be a multiple of 16
    const __mmask16 t = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(t, a + k), _mm512_maskz_loadu_ps(t, b + k), s0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#else
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < K; ++k) s += a[k] * b[k];
  return s;
#endif
}

#if defined(__AVX512F__)
// 16 floats -> bf16, rounding to nearest even with NaN kept quiet: from_float<bf16> on each lane.
inline __m256i narrow_bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

// The same, in one instruction where the CPU has AVX512-BF16: vcvtneps2bf16 rounds to nearest
// even and quiets NaNs the same way, but flushes float32 denormals to zero, so lanes holding one
// (fpclass 0x20; next to never in a model) take the integer path. Measured: the bf16 element-wise
// kernels (elementwise.cpp, norm.cpp) spent most of their instructions narrowing (rotary at 64
// rows, one thread: 25 -> 16 us, silu * up 77 -> 58 us).
inline __m256i narrow_bf16(__m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  const __m256i r = (__m256i)_mm512_cvtneps_pbh(v);
  const __mmask16 denormal = _mm512_fpclass_ps_mask(v, 0x20);
  if (__builtin_expect(denormal == 0, 1)) return r;
  return _mm256_mask_blend_epi16(denormal, r, narrow_bf16_bits(v));
#else
  return narrow_bf16_bits(v);
#endif
}

// 16 elements (or the first n < 16, the rest zero) widened to float32.
inline __m512 load16(const float* p, int64_t n = 16) {
  return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
inline __m512 load16(const bf16* p, int64_t n = 16) {
  const __m256i raw = n >= 16 ? _mm256_loadu_si256((const __m256i*)p)
                              : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));  // bf16 -> f32 is a shift
}
#endif

#if defined(__AVX512F__)
// 16 fp8 entries (or the first n) widened to float32, as to_float above.
template <int kMantShift, uint32_t kScaleBits>
inline __m512 load16_fp8(const uint8_t* p, int64_t n) {
  const __m128i raw = n >= 16 ? _mm_loadu_si128((const __m128i*)p) : _mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), p);
  const __m512i b = _mm512_cvtepu8_epi32(raw);
  const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), kMantShift);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(mag, sign)), _mm512_castsi512_ps(_mm512_set1_epi32(kScaleBits)));
}
inline __m512 load16(const fp8e4m3* p, int64_t n = 16) {
  return load16_fp8<20, 0x7b800000u>((const uint8_t*)p, n);  // 2^120
}
inline __m512 load16(const fp8e5m2* p, int64_t n = 16) {
  return load16_fp8<21, 0x77800000u>((const uint8_t*)p, n);  // 2^112
}
#endif

// sum_k x[k] * w[k] for fp8 w (KV cache rows), in float32.
template <typename F8>
inline float dot_fp8(const float* x, const F8* w, int64_t K) {
#if defined(__AVX512F__)
  __m512 s = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) s = _mm512_fmadd_ps(load16(x + k, K - k), load16(w + k, K - k), s);
  return _mm512_reduce_add_ps(s);
#else
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) s += x[k] * to_float(w[k]);
  return s;
#endif
}
inline float dot(const float* x, const fp8e4m3* w, int64_t K) { return dot_fp8(x, w, K); }
inline float dot(const float* x, const fp8e5m2* w, int64_t K) { return dot_fp8(x, w, K); }

// sum_k x[k] * w[k] for bfloat16 w, in float32 (natural order, widened 16 at a time).
inline float dot(const float* x, const bf16* w, int64_t K) {
#if defined(__AVX512F__)
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(w + k), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), load16(w + k + 16), s1);
  }
  for (; k < K; k += 16) s0 = _mm512_fmadd_ps(load16(x + k, K - k), load16(w + k, K - k), s0);
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#else
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < K; ++k) s += x[k] * to_float(w[k]);
  return s;
#endif
}

// o[d] += p * v[d] over D elements.
template <typename T>
inline void axpy(float p, const T* v, float* o, int64_t D) {
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (int64_t d = 0; d < D; d += 16) {
    const int64_t n = D - d;
    const __m512 r = _mm512_fmadd_ps(pv, load16(v + d, n), load16(o + d, n));
    if (n >= 16)
      _mm512_storeu_ps(o + d, r);
    else
      _mm512_mask_storeu_ps(o + d, (__mmask16)((1u << n) - 1), r);
  }
#else
  for (int64_t d = 0; d < D; ++d) o[d] += p * to_float(v[d]);
#endif
}

}  // namespace pagemill
