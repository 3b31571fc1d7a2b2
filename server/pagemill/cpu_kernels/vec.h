// Inner loops shared by the CPU kernels: a float32 dot product and paged
// attention of one kv head's query group against one sequence's cache.
#pragma once
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagemill {

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

// Where a sequence's cache rows live: [num_blocks, block_size, kv_heads, head_dim].
struct PagedKV {
  const float* k;
  const float* v;
  const int32_t* block_table;  // this sequence's blocks
  int64_t block_size, kv_heads, head_dim;

  inline int64_t row(int64_t t, int64_t kv_head) const {
    const int64_t block = block_table[t / block_size];
    return ((block * block_size + t % block_size) * kv_heads + kv_head) * head_dim;
  }
};

// out[g] = softmax(scale * q[g] . K^T) V over the first `len` tokens, for the
// `group` query heads q[0..group) (stride q_stride) that share `kv_head`.
// One pass over K for the whole group. scores: group * len floats of scratch.
inline void attend_group(const float* q, int64_t q_stride, int64_t group, const PagedKV& kv, int64_t kv_head,
                         int64_t len, float scale, float* scores, float* out, int64_t out_stride) {
  const int64_t D = kv.head_dim;
  for (int64_t t = 0; t < len; ++t) {
    const float* k = kv.k + kv.row(t, kv_head);
    for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(q + g * q_stride, k, D) * scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    float m = -INFINITY;
    for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) sum += (s[t] = expf(s[t] - m));
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
    float* o = out + g * out_stride;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
  }
  for (int64_t t = 0; t < len; ++t) {
    const float* v = kv.v + kv.row(t, kv_head);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t];
      float* o = out + g * out_stride;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
    }
  }
}

}  // namespace pagemill
