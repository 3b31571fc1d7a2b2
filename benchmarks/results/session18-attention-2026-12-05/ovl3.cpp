// ovl2.cpp's schedule in the kernel's own loop nests: each 16-row chunk per kv head j (128 of every
// 384 bytes of a row) and per query head g (3 x 3, the default model's GQA), the next block's share
// asked for at each g (MODE 0, as paged_attention_spans.h does), or the chunk's rows front to back with
// the share spread per row (MODE 1). WORK: 4 x WORK FMAs per head and row (a latency-bound chain).
//
//   g++ -O3 -march=native -fopenmp -o ovl3 ovl3.cpp
//   OMP_NUM_THREADS=2 ./ovl3 MODE WORK TASKS [POOL_MIB]
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <chrono>
#include <vector>
#include <random>
#include <algorithm>
static char* huge(int64_t n) { char* p = (char*)aligned_alloc(1 << 21, n); madvise(p, n, MADV_HUGEPAGE); memset(p, 1, n); return p; }
constexpr int64_t BS = 64, ROW = 384, BLK = BS * ROW, NKV = 3, G = 3, HB = 128;
struct Ahead { const char* p; int64_t lines;
  inline void at(int64_t i, int64_t n) const { for (int64_t x = i * lines / n; x < (i + 1) * lines / n; ++x) _mm_prefetch(p + 64 * x, _MM_HINT_T1); } };
static Ahead share(const char* nx, int64_t r0, int64_t n, int64_t j, int64_t nkv) {
  if (!nx) return {nullptr, 0};
  const int64_t lines = n * ROW / 64, l0 = j * lines / nkv, l1 = (j + 1) * lines / nkv;
  return {nx + r0 * ROW + 64 * l0, l1 - l0};
}
int main(int argc, char** argv) {
  const int mode = atoi(argv[1]), work = atoi(argv[2]), tasks = atoi(argv[3]); const int nb = 4;
  const int64_t pool = (argc > 4 ? (int64_t)atoi(argv[4]) : 1024LL) << 20, nblk = pool / BLK;
  char* K = huge(pool); char* V = huge(pool);
  std::mt19937 rng(1); std::vector<int> tab(tasks * nb); std::vector<double> ts; float dummy = 0;
  for (int r = 0; r < 31; ++r) {
    for (auto& t : tab) t = rng() % nblk;
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+:dummy)
    {
      __m512 a[8]; for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
      auto rowwork = [&](const char* p, int w) {  // one head's 128 B of a row: 2 lines
        __m512 x0 = _mm512_load_ps(p), x1 = _mm512_load_ps(p + 64);
        for (int k = 0; k < w; ++k) { a[0] = _mm512_fmadd_ps(x0, x1, a[0]); a[1] = _mm512_fmadd_ps(x1, x0, a[1]); a[2] = _mm512_fmadd_ps(x0, x0, a[2]); a[3] = _mm512_fmadd_ps(x1, x1, a[3]); }
      };
      auto pass = [&](const char* cache, const int* t, const char* const* nxt) {
        for (int b = 0; b < nb; ++b) {
          const char* blk = cache + (int64_t)t[b] * BLK; const char* nx = nxt[b];
          for (int64_t c0 = 0; c0 < BS; c0 += 16) {
            if (mode == 0) {
              for (int64_t j = 0; j < NKV; ++j) {
                const Ahead ah = share(nx, c0, 16, j, NKV);
                for (int64_t g = 0; g < G; ++g) { ah.at(g, G); for (int64_t i = 0; i < 16; ++i) rowwork(blk + (c0 + i) * ROW + j * HB, work); }
              }
            } else {
              const Ahead ah = share(nx, c0, 16, 0, 1);
              for (int64_t i = 0; i < 16; ++i) { ah.at(i, 16); for (int64_t j = 0; j < NKV; ++j) for (int64_t g = 0; g < G; ++g) rowwork(blk + (c0 + i) * ROW + j * HB, work); }
            }
          }
        }
      };
#pragma omp for schedule(dynamic, 4)
      for (int i = 0; i < tasks; ++i) {
        const int* t = tab.data() + i * nb;
        const char* nk[4] = {K + (int64_t)t[1] * BLK, K + (int64_t)t[2] * BLK, K + (int64_t)t[3] * BLK, V + (int64_t)t[0] * BLK};
        const char* nv[4] = {V + (int64_t)t[1] * BLK, V + (int64_t)t[2] * BLK, V + (int64_t)t[3] * BLK, i + 1 < tasks ? K + (int64_t)tab[(i + 1) * nb] * BLK : nullptr};
        pass(K, t, nk); pass(V, t, nv);
      }
      __m512 s = a[0]; for (int i = 1; i < 8; ++i) s = _mm512_add_ps(s, a[i]);
      dummy += _mm512_reduce_add_ps(s);
    }
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  printf("mode %d work %d: median %.3f ms, %.1f GB/s (%g)\n", mode, work, ts[15] * 1e3, 2.0 * tasks * nb * BLK / ts[15] / 1e9, dummy);
}
