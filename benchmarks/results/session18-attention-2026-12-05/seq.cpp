// One thread reading a 1 GiB buffer (2 MiB pages) with plain AVX-512 loads: random chunks of 64 B
// to 1 MiB, 256 MiB in all, then 256 MiB sequentially. How far the hardware prefetchers carry
// contiguous reads on this machine (software-prefetched streams are bounded by the core's fill buffers).
//
//   g++ -O3 -march=native -o seq seq.cpp && ./seq
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <chrono>
#include <vector>
#include <random>
int main() {
  const int64_t pool = 1LL << 30;
  char* B = (char*)aligned_alloc(1 << 21, pool); madvise(B, pool, MADV_HUGEPAGE); memset(B, 1, pool);
  std::mt19937_64 rng(1);
  for (int64_t chunk : {64LL, 256LL, 1024LL, 4096LL, 24576LL, 1LL << 20}) {
    const int64_t n = (256LL << 20) / chunk; std::vector<int64_t> offs(n);
    for (auto& o : offs) o = (int64_t)(rng() % (pool / chunk)) * chunk;
    double best = 1e9; float d = 0;
    for (int r = 0; r < 3; ++r) {
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      auto t = std::chrono::steady_clock::now();
      for (int64_t c = 0; c < n; ++c) {
        const char* p = B + offs[c];
        for (int64_t o = 0; o < chunk; o += 256) {
          a0 = _mm512_add_ps(a0, _mm512_load_ps(p + o));
          if (chunk >= 256) { a1 = _mm512_add_ps(a1, _mm512_load_ps(p + o + 64)); a2 = _mm512_add_ps(a2, _mm512_load_ps(p + o + 128)); a3 = _mm512_add_ps(a3, _mm512_load_ps(p + o + 192)); }
        }
      }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(); if (s < best) best = s;
      d += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
    printf("random %7ld B chunks: %.1f GB/s (%g)\n", chunk, (double)n * chunk / best / 1e9, d);
  }
  double best = 1e9; float d = 0;
  for (int r = 0; r < 3; ++r) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    auto t = std::chrono::steady_clock::now();
    for (int64_t o = 0; o < (256LL << 20); o += 256) { a0 = _mm512_add_ps(a0, _mm512_load_ps(B + o)); a1 = _mm512_add_ps(a1, _mm512_load_ps(B + o + 64)); a2 = _mm512_add_ps(a2, _mm512_load_ps(B + o + 128)); a3 = _mm512_add_ps(a3, _mm512_load_ps(B + o + 192)); }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(); if (s < best) best = s;
    d += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
  printf("sequential 256 MiB: %.1f GB/s (%g)\n", (256.0 * (1 << 20)) / best / 1e9, d);
}
