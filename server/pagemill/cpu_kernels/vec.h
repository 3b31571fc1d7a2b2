// Inner loops shared by the CPU kernels: the element types (float32 and
// bfloat16), dot products of float activations against either, and paged
// attention of one kv head's query group against one sequence's cache.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagemill {

// bfloat16 as its raw bits (the upper half of a float32); a struct so that it
// never converts to or from an integer by accident.
struct bf16 {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
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
// chains keep both FMA ports busy while the loads stream.
inline float dot(const float* a, const float* b, int64_t K) {
#if defined(__AVX512F__)
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
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

// Where a sequence's cache rows live: [num_blocks, block_size, kv_heads, head_dim].
template <typename T>
struct PagedKV {
  const T* k;
  const T* v;
  const int32_t* block_table;  // this sequence's blocks
  int64_t block_size, kv_heads, head_dim;

  inline int64_t row(int64_t t, int64_t kv_head) const {
    const int64_t block = block_table[t / block_size];
    return ((block * block_size + t % block_size) * kv_heads + kv_head) * head_dim;
  }
};

// out[g] = softmax(scale * q[g] . K^T) V over tokens first..len-1 (first > 0:
// a sliding window dropped the older ones), for the `group` query heads
// q[0..group) (stride q_stride) that share `kv_head`. One pass over K for the
// whole group. scores: group * (len - first) floats of scratch.
// The cache holds T (float or bf16); q, scores and out are float32.
template <typename T>
inline void attend_group(const float* q, int64_t q_stride, int64_t group, const PagedKV<T>& kv, int64_t kv_head,
                         int64_t first, int64_t len, float scale, float* scores, float* out, int64_t out_stride) {
  const int64_t D = kv.head_dim, n = len - first;
  for (int64_t t = 0; t < n; ++t) {
    const T* k = kv.k + kv.row(first + t, kv_head);
    for (int64_t g = 0; g < group; ++g) scores[g * n + t] = dot(q + g * q_stride, k, D) * scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * n;
    float m = -INFINITY;
    for (int64_t t = 0; t < n; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) sum += (s[t] = expf(s[t] - m));
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
    float* o = out + g * out_stride;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
  }
  for (int64_t t = 0; t < n; ++t) {
    const T* v = kv.v + kv.row(first + t, kv_head);
    for (int64_t g = 0; g < group; ++g) axpy(scores[g * n + t], v, out + g * out_stride, D);
  }
}

}  // namespace pagemill
