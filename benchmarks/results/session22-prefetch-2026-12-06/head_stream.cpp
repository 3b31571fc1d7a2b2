// The default model's output head (49152 x 576 bf16) at batch 1, 2 threads, over a ring of 6
// copies in huge pages: the matvec as it was (v0), with the weight lines asked for DIST bytes
// ahead in its k loop (v3-DIST, what vec.h's ask_ahead does), and a plain read of the same bytes.
// Build: g++ -O3 -march=native -fopenmp head_stream.cpp -o head_stream && ./head_stream
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <stdint.h>
#include <algorithm>
typedef uint16_t bf16;
static const int64_t N = 49152, K = 576;
// V0: the current kernel: one row at a time, two chains
static inline float row_dot(const bf16* w, const bf16* x) {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(w + k + 32), (__m512bh)_mm512_loadu_si512(x + k + 32));
  }
  for (; k < K; k += 32) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
  return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}
static inline bf16 tobf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }
void v0(const bf16* w, const bf16* x, bf16* y) {
#pragma omp parallel for schedule(static) num_threads(2)
  for (int64_t n = 0; n < N; ++n) y[n] = tobf(row_dot(w + n * K, x));
}
// V1: 4 rows at a time (independent chains), x in registers
void v1(const bf16* w, const bf16* x, bf16* y) {
#pragma omp parallel num_threads(2)
  {
    int t = omp_get_thread_num(); int64_t n0 = N * t / 2, n1 = N * (t + 1) / 2;
    __m512bh xv[18];
    for (int i = 0; i < 18; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + 32 * i);
    for (int64_t n = n0; n < n1; n += 4) {
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      const bf16* r = w + n * K;
#pragma GCC unroll 18
      for (int i = 0; i < 18; ++i) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(r + 32 * i), xv[i]);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(r + K + 32 * i), xv[i]);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(r + 2 * K + 32 * i), xv[i]);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(r + 3 * K + 32 * i), xv[i]);
      }
      y[n] = tobf(_mm512_reduce_add_ps(a0)); y[n + 1] = tobf(_mm512_reduce_add_ps(a1));
      y[n + 2] = tobf(_mm512_reduce_add_ps(a2)); y[n + 3] = tobf(_mm512_reduce_add_ps(a3));
    }
  }
}
// V2: V0 + software prefetch DIST bytes ahead
template <int DIST>
void v2(const bf16* w, const bf16* x, bf16* y) {
#pragma omp parallel for schedule(static) num_threads(2)
  for (int64_t n = 0; n < N; ++n) {
    const char* p = (const char*)(w + n * K) + DIST;
    for (int l = 0; l < 18; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
    y[n] = tobf(row_dot(w + n * K, x));
  }
}
// V3: prefetch inside the k loop (each 64-byte line DIST ahead), as rows_dot would
template <int DIST>
static inline float row_dot_pf(const bf16* w, const bf16* x) {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  const char* p = (const char*)w + DIST;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    _mm_prefetch(p + 2 * k, _MM_HINT_T0); _mm_prefetch(p + 2 * k + 64, _MM_HINT_T0);
    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(w + k + 32), (__m512bh)_mm512_loadu_si512(x + k + 32));
  }
  for (; k < K; k += 32) { _mm_prefetch(p + 2 * k, _MM_HINT_T0); a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k)); }
  return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}
template <int DIST>
void v3(const bf16* w, const bf16* x, bf16* y) {
#pragma omp parallel for schedule(static) num_threads(2)
  for (int64_t n = 0; n < N; ++n) y[n] = tobf(row_dot_pf<DIST>(w + n * K, x));
}
// pure read
float vr(const bf16* w) {
  float tot = 0;
#pragma omp parallel num_threads(2) reduction(+ : tot)
  {
    int t = omp_get_thread_num(); const char* p = (const char*)w + N * K * 2 * t / 2; int64_t n = N * K * 2 / 2;
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 64) s = _mm512_add_ps(s, _mm512_load_ps((const float*)(p + i)));
    tot += _mm512_reduce_add_ps(s);
  }
  return tot;
}
int main(int argc, char** argv) {
  const int C = 6; size_t bytes = N * K * 2;
  bf16* ws[C];
  for (int c = 0; c < C; ++c) { ws[c] = (bf16*)aligned_alloc(1 << 21, bytes); madvise(ws[c], bytes, MADV_HUGEPAGE); for (size_t i = 0; i < N * K; ++i) ws[c][i] = 0x3f80 + (i % 7); }
  bf16 x[K]; for (int k = 0; k < K; ++k) x[k] = 0x3f00 + k % 5;
  bf16* y = (bf16*)aligned_alloc(64, N * 2); bf16* y2 = (bf16*)aligned_alloc(64, N * 2);
  v0(ws[0], x, y); v1(ws[0], x, y2); printf("v1 equal %d\n", memcmp(y, y2, N * 2) == 0);
  const char* names[] = {"v0", "v3-512", "v3-1k", "v3-1.5k", "v3-2k", "read", "v3-3k", "v3-768"};
  double tm[8][16]; float sink = 0;
  for (int r = 0; r < 16; ++r)
    for (int v = 0; v < 8; ++v) {
      double t0 = omp_get_wtime();
      for (int c = 0; c < C; ++c) {
        if (v == 0) v0(ws[c], x, y); else if (v == 1) v3<512>(ws[c], x, y); else if (v == 2) v3<1024>(ws[c], x, y);
        else if (v == 3) v3<1536>(ws[c], x, y); else if (v == 4) v3<2048>(ws[c], x, y); else if (v == 5) sink += vr(ws[c]);
        else if (v == 6) v3<3072>(ws[c], x, y); else v3<768>(ws[c], x, y);
      }
      tm[v][r] = (omp_get_wtime() - t0) / C;
    }
  for (int v = 0; v < 8; ++v) { std::sort(tm[v], tm[v] + 16); printf("%-6s %.3f ms  %.1f GB/s\n", names[v], tm[v][8] * 1e3, bytes / tm[v][8] / 1e9); }
  printf("%g\n", sink);
}
