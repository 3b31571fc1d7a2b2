// Sums whose order is fixed by their length alone (--batch-invariant): a dot product is 8
// lanes of fused multiply-adds over k = lane, lane + 8, ... in increasing k (a tail past
// the end reads zeros), then the lanes added in one fixed tree. Every kernel that uses
// these gives an element the same bits whatever else it computes with it, whichever
// thread takes it, and with or without AVX2 (the scalar lanes below round like the vector
// ones: one rounding per fused multiply-add).
#pragma once
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "common/vec.h"

namespace pagemill::fixed {

constexpr int kLanes = 8;

inline float tree(const float* l) { return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])); }

#if defined(__AVX2__) && defined(__FMA__)
using Lanes = __m256;
inline Lanes zero() { return _mm256_setzero_ps(); }
inline Lanes load(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes load(const bf16* p) {
  const __m128i h = _mm_loadu_si128((const __m128i*)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <class T>  // fp8 cache entries
inline Lanes load(const T* p) {
  alignas(32) float t[kLanes];
  for (int i = 0; i < kLanes; ++i) t[i] = to_float(p[i]);
  return _mm256_load_ps(t);
}
inline Lanes fma(Lanes a, Lanes b, Lanes acc) { return _mm256_fmadd_ps(a, b, acc); }
inline float sum(Lanes v) {
  alignas(32) float l[kLanes];
  _mm256_store_ps(l, v);
  return tree(l);
}
inline Lanes from(const float* l) { return _mm256_loadu_ps(l); }
#else
struct Lanes {
  float l[kLanes];
};
inline Lanes zero() { return Lanes{}; }
template <class T>
inline Lanes load(const T* p) {
  Lanes v;
  for (int i = 0; i < kLanes; ++i) v.l[i] = to_float(p[i]);
  return v;
}
inline Lanes fma(Lanes a, Lanes b, Lanes acc) {
  for (int i = 0; i < kLanes; ++i) acc.l[i] = fmaf(a.l[i], b.l[i], acc.l[i]);
  return acc;
}
inline float sum(Lanes v) { return tree(v.l); }
inline Lanes from(const float* l) { return load(l); }
#endif

// The first n < 8 elements of p, zeros after.
template <class T>
inline Lanes load_tail(const T* p, int64_t n) {
  float t[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t i = 0; i < n; ++i) t[i] = to_float(p[i]);
  return from(t);
}

// sum_k a[k] * b[k] in the fixed order.
template <class A, class B>
inline float dot(const A* a, const B* b, int64_t K) {
  Lanes acc = zero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) acc = fma(load(a + k), load(b + k), acc);
  if (k < K) acc = fma(load_tail(a + k, K - k), load_tail(b + k, K - k), acc);
  return sum(acc);
}

}  // namespace pagemill::fixed
