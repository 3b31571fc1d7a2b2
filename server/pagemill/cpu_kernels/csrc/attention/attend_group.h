// paged_attention.h's per-(sequence, kv head) path: the scores, softmax and value sums of one
// query group over its paged keys, and the helpers paged_attention_spans.h shares.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "common/simd_math.h"  // first, transpose_sum16, exp_nonpositive
#include "common/vec.h"

namespace pagemill {

// An int8 KV cache entry; each row of head_dim of them is followed by the
// row's float32 scale (entry * scale is the value).
struct q8 {
  int8_t bits;
};
inline float to_float(q8 v) { return (float)v.bits; }

// Whether T's rows carry a scale, and how many T that takes after head_dim.
template <typename T>
constexpr bool kScaled = false;
template <>
constexpr bool kScaled<q8> = true;
template <typename T>
constexpr int64_t kRowExtra = kScaled<T> ? 4 : 0;

// The scale of the row at `row` (head_dim D); 1 for unscaled types.
template <typename T>
inline float row_scale(const T* row, int64_t D) {
  if constexpr (kScaled<T>) {
    float s;
    memcpy(&s, row + D, sizeof(float));
    return s;
  } else {
    (void)row, (void)D;
    return 1.f;
  }
}

#if defined(__AVX512F__)
// 16 int8 entries (or the first n) widened to float32, unscaled.
inline __m512 load16(const q8* p, int64_t n = 16) {
  const __m128i raw = n >= 16 ? _mm_loadu_si128((const __m128i*)p) : _mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), p);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
}
#endif

// sum_k x[k] * w[k] for int8 w, unscaled, in float32.
inline float dot(const float* x, const q8* w, int64_t K) {
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

// Where a sequence's cache rows live: [num_blocks, block_size, kv_heads, pitch],
// pitch = head_dim (+ the scale of an int8 row).
template <typename T>
struct PagedKV {
  const T* k;
  const T* v;
  const int32_t* block_table;  // this sequence's blocks
  int64_t block_size, kv_heads, head_dim;

  inline int64_t pitch() const { return head_dim + kRowExtra<T>; }

  inline int64_t row(int64_t t, int64_t kv_head) const {
    const int64_t block = block_table[t / block_size];
    return ((block * block_size + t % block_size) * kv_heads + kv_head) * pitch();
  }

  // out[t - first] = row(t, kv_head) for first <= t < len, block by block (no division per token).
  inline void rows(int64_t first, int64_t len, int64_t kv_head, int64_t* out) const {
    const int64_t stride = kv_heads * pitch();
    for (int64_t t = first; t < len;) {
      const int64_t b = t / block_size, i0 = t % block_size;
      const int64_t base = (int64_t)block_table[b] * block_size * stride + kv_head * pitch();
      const int64_t end = (b + 1) * block_size < len ? (b + 1) * block_size : len;
      for (int64_t i = i0; t < end; ++i, ++t) out[t - first] = base + i * stride;
    }
  }
};

// The portable loop: out[g] = softmax(scale * q[g] . K^T) V over tokens first..len-1.
template <typename T>
inline void attend_group_scalar(const float* q, int64_t q_stride, int64_t group, const PagedKV<T>& kv,
                                int64_t kv_head, int64_t first, int64_t len_end, float scale, float* scores,
                                float* out, int64_t out_stride) {
  const int64_t D = kv.head_dim, len = len_end - first;
  for (int64_t t = 0; t < len; ++t) {
    const T* k = kv.k + kv.row(first + t, kv_head);
    const float ks = scale * row_scale(k, D);
    for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(q + g * q_stride, k, D) * ks;
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
    const T* v = kv.v + kv.row(first + t, kv_head);
    const float vs = row_scale(v, D);
    for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + t] * vs, v, out + g * out_stride, D);
  }
}

#if defined(__AVX512F__)

template <typename T, int kHint = _MM_HINT_T0>
inline void prefetch_row(const T* p, int64_t D) {
  for (int64_t b = 0; b < D * (int64_t)sizeof(T); b += 64) _mm_prefetch((const char*)p + b, (_mm_hint)kHint);
}


// The query of one head as the key rows meet it: bf16 pairs for vdpbf16ps, or float32.
template <typename T>
struct QueryRow {
  static constexpr bool kDp = false;
  const float* q;
};
#if defined(__AVX512BF16__)
template <>
struct QueryRow<bf16> {
  static constexpr bool kDp = true;
  __m512bh q[8];  // head_dim <= 256
};
#endif

// acc += q . k over D for one key row (16 partial sums in the lanes).
template <typename T>
inline __m512 qk_partial(const QueryRow<T>& q, const T* k, int64_t D, __m512 acc) {
#if defined(__AVX512BF16__)
  if constexpr (QueryRow<T>::kDp) {
    for (int64_t c = 0; c < D / 32; ++c)
      acc = _mm512_dpbf16_ps(acc, q.q[c], (__m512bh)_mm512_loadu_si512((const void*)(k + 32 * c)));
    return acc;
  }
#endif
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.q + d), load16(k + d), acc);
  return acc;
}

// scores[g * len + t] = scale * q[g] . k[t] for every t < len.
template <typename T>
inline void group_scores(const float* q, int64_t q_stride, int64_t group, const T* keys, const T* values,
                         const int64_t* offs, int64_t D, int64_t len, float scale, float* scores) {
  const __m512 sc = _mm512_set1_ps(scale);
  const T* rows[16];
  const int64_t P = D + kRowExtra<T>;  // the bytes a row's prefetch covers, its scale included
  for (int64_t i = 0; i < 32 && i < len; ++i) prefetch_row(keys + offs[i], P);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = len - t0 < 16 ? len - t0 : 16;
    for (int64_t i = 0; i < n; ++i) rows[i] = keys + offs[t0 + i];
    // The blocks are scattered over the pool, so no hardware prefetcher finds
    // them: ask for the key rows two chunks ahead, and this chunk's value rows
    // into L2 for group_values (measured: the loads stalled on memory).
    for (int64_t i = t0 + 32; i < t0 + 48 && i < len; ++i) prefetch_row(keys + offs[i], P);
    for (int64_t i = t0; i < t0 + n; ++i) prefetch_row<T, _MM_HINT_T1>(values + offs[i], P);
    __m512 chunk_sc = sc;
    if constexpr (kScaled<T>) {  // each key's scale on its score
      alignas(64) float ks[16] = {};
      for (int64_t i = 0; i < n; ++i) ks[i] = row_scale(rows[i], D);
      chunk_sc = _mm512_mul_ps(sc, _mm512_load_ps(ks));
    }
    for (int64_t g = 0; g < group; ++g) {
      QueryRow<T> qr;
      if constexpr (QueryRow<T>::kDp) {
#if defined(__AVX512BF16__)
        const float* qg = q + g * q_stride;
        for (int64_t c = 0; c < D / 32; ++c)
          qr.q[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qg + 32 * c + 16), _mm512_loadu_ps(qg + 32 * c));
#endif
      } else {
        qr.q = q + g * q_stride;
      }
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; ++i) acc[i] = qk_partial(qr, rows[i], D, acc[i]);
      _mm512_mask_storeu_ps(scores + g * len + t0, first(n), _mm512_mul_ps(transpose_sum16(acc), chunk_sc));
    }
  }
}

// s[t] = e^(s[t] - max s) over len; returns the sum (and the max in *max_out).
inline float exp_shifted(float* s, int64_t len, float* max_out = nullptr) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; t += 16) {  // masked: the row may end at the end of its page
    const __mmask16 k = first(len - t);
    m = _mm512_mask_max_ps(m, k, _mm512_maskz_loadu_ps(k, s + t), m);
  }
  const float top = _mm512_reduce_max_ps(m);
  if (max_out) *max_out = top;
  const __m512 mx = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 k = first(len - t);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), mx));
    _mm512_mask_storeu_ps(s + t, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// A value row as NV float32 vectors in the value pass's order: bf16 as the even
// and the odd entries of each 32 (a shift and a mask, no shuffle: bf16 is the
// top half of a float32), other types in order. store_values undoes the order.
template <typename T, int NV>
constexpr bool kEvenOdd = std::is_same_v<T, bf16> && NV % 2 == 0;

template <int NV, typename T>
inline void widen_values(const T* v, __m512* vf) {
  if constexpr (kEvenOdd<T, NV>) {
    for (int c = 0; c < NV / 2; ++c) {
      const __m512i x = _mm512_loadu_si512((const void*)(v + 32 * c));
      vf[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      vf[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
    }
  } else {
    for (int c = 0; c < NV; ++c) vf[c] = load16(v + 16 * c);
  }
}

template <int NV, typename T>
inline void store_values(const __m512* o, __m512 inv, float* out) {
  if constexpr (kEvenOdd<T, NV>) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int c = 0; c < NV / 2; ++c) {
      _mm512_storeu_ps(out + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(o[2 * c], lo, o[2 * c + 1]), inv));
      _mm512_storeu_ps(out + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(o[2 * c], hi, o[2 * c + 1]), inv));
    }
  } else {
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(o[c], inv));
  }
}

// out[g] = (sum_t p[g][t] v[t]) * inv[g] for heads g < G, D = 16 * NV.
template <int NV, int G, typename T>
inline void group_values(const float* p, int64_t len, const T* values, const int64_t* offs, const float* inv,
                         float* out, int64_t out_stride) {
  __m512 o[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) o[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const T* v = values + offs[t];
    if (t + 16 < len) prefetch_row(values + offs[t + 16], 16 * NV + kRowExtra<T>);
    __m512 vf[NV];
    widen_values<NV>(v, vf);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * len + t]);
      for (int c = 0; c < NV; ++c) o[g][c] = _mm512_fmadd_ps(pg, vf[c], o[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) store_values<NV, T>(o[g], _mm512_set1_ps(inv[g]), out + g * out_stride);
}

// The passes over the values that `group` heads take: as few as keep G * NV
// accumulators in registers (<= 24, + NV value vectors), as even as they can
// be (group 3 is one pass of 3, not 3 of 1: each pass loads and widens every row).
template <int NV>
constexpr int kMaxG = NV <= 4 ? 6 : (NV <= 6 ? 4 : (NV <= 8 ? 2 : 1));
inline int64_t value_passes(int64_t group, int64_t max_g) { return (group + max_g - 1) / max_g; }

// All heads of the group in the passes value_passes() gives.
template <int NV, typename T>
inline void values_chunked(const float* p, int64_t group, int64_t len, const T* values, const int64_t* offs,
                           const float* inv, float* out, int64_t out_stride) {
  const int64_t passes = value_passes(group, kMaxG<NV>);
  for (int64_t i = 0, g = 0; i < passes; ++i) {
    const int64_t G = (group - g) / (passes - i);  // the rest shared evenly over the passes left
    const float* pg = p + g * len;
    float* og = out + g * out_stride;
    switch (G) {  // G <= kMaxG<NV>: the cases above it are never taken
#define PAGEMILL_VALUES_G(n) \
  case n:                    \
    if constexpr (kMaxG<NV> >= n) group_values<NV, n>(pg, len, values, offs, inv + g, og, out_stride); \
    break;
      PAGEMILL_VALUES_G(1) PAGEMILL_VALUES_G(2) PAGEMILL_VALUES_G(3)
      PAGEMILL_VALUES_G(4) PAGEMILL_VALUES_G(5) PAGEMILL_VALUES_G(6)
#undef PAGEMILL_VALUES_G
      default: break;
    }
    g += G;
  }
}

template <typename T>
inline bool attend_group_avx512(const float* q, int64_t q_stride, int64_t group, const PagedKV<T>& kv,
                                int64_t kv_head, int64_t first, int64_t len_end, float scale, float* scores,
                                float* out, int64_t out_stride) {
  const int64_t D = kv.head_dim, len = len_end - first;
  if (D % 16 != 0 || D > 256 || group > 64) return false;
  if (QueryRow<T>::kDp && D % 32 != 0) return false;
  static thread_local std::vector<int64_t> offs;  // each token's row, for this kv head
  offs.resize(len);
  kv.rows(first, len_end, kv_head, offs.data());
  group_scores(q, q_stride, group, kv.k, kv.v, offs.data(), D, len, scale, scores);
  float inv[64];
  for (int64_t g = 0; g < group; ++g) inv[g] = 1.f / exp_shifted(scores + g * len, len);
  if constexpr (kScaled<T>) {  // each value's scale on its probabilities (after the sums above)
    for (int64_t t = 0; t < len; ++t) {
      const float vs = row_scale(kv.v + offs[t], D);
      for (int64_t g = 0; g < group; ++g) scores[g * len + t] *= vs;
    }
  }
  const int64_t* o = offs.data();
  switch (D / 16) {
    case 4: values_chunked<4>(scores, group, len, kv.v, o, inv, out, out_stride); return true;
    case 5: values_chunked<5>(scores, group, len, kv.v, o, inv, out, out_stride); return true;
    case 6: values_chunked<6>(scores, group, len, kv.v, o, inv, out, out_stride); return true;
    case 8: values_chunked<8>(scores, group, len, kv.v, o, inv, out, out_stride); return true;
    case 16: values_chunked<16>(scores, group, len, kv.v, o, inv, out, out_stride); return true;
    default: break;
  }
  // Other head sizes: the scalar loop's value pass over the probabilities.
  for (int64_t g = 0; g < group; ++g) {
    float* o = out + g * out_stride;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    for (int64_t t = 0; t < len; ++t) axpy(scores[g * len + t] * inv[g], kv.v + kv.row(first + t, kv_head), o, D);
  }
  return true;
}
#endif

// out[g] = softmax(scale * q[g] . K^T) V over tokens first..len-1 (len > first;
// first > 0: a sliding window dropped the older ones), for the `group` query
// heads q[0..group) (stride q_stride) that share `kv_head`. scores: group *
// (len - first) floats of scratch. The cache holds T (float, bf16, fp8 or scaled int8);
// q, scores and out are float32.
template <typename T>
inline void attend_group(const float* q, int64_t q_stride, int64_t group, const PagedKV<T>& kv, int64_t kv_head,
                         int64_t first, int64_t len, float scale, float* scores, float* out, int64_t out_stride) {
#if defined(__AVX512F__)
  if (attend_group_avx512(q, q_stride, group, kv, kv_head, first, len, scale, scores, out, out_stride)) return;
#endif
  attend_group_scalar(q, q_stride, group, kv, kv_head, first, len, scale, scores, out, out_stride);
}

// The first key a query at position len - 1 sees: window > 0 keeps the last
// `window` keys (as transformers' sliding mask: key position > query position - window).
inline int64_t first_key(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

}  // namespace pagemill
