// A replica of the decode-attention kernel's memory schedule (paged_attention_spans.h) with stand-in
// arithmetic: tasks of NB K blocks, then the same NB positions' V blocks (24 KiB each, the default
// model's 64-token block), drawn at random from two pools; each block read front to back, 256 B at a
// time, with `work` x 8 FMAs per 256 B (work 12 runs at about the kernel's in-cache rate), while the
// next item (the next K block, the first V block, the next task's first K block) is asked for.
//
//   g++ -O3 -march=native -fopenmp -o ovl2 ovl2.cpp
//   OMP_NUM_THREADS=2 ./ovl2 PF WORK TASKS NB DYNAMIC ONE_POOL [POOL_MIB]
//
// PF: 0 no prefetch; 1 every line of the next item into L2 (prefetcht1), in step with the current
// block (the kernel's scheme); k > 1 every k-th line; -k the first k lines of each 4 KiB page;
// 100 + k a plain load of every k-th line instead of a prefetch; 200 the whole block loaded first
// (plain loads, which the L2 streamer follows), then the arithmetic from L1; 201 the same plus the
// next item's first lines prefetched. DYNAMIC: schedule(dynamic, 4) like the kernel, else static.
// ONE_POOL 1 makes V the same blocks as K (not a realistic case: the V pass then hits the cache).
// POOL_MIB (default 1024) per pool: 1 puts everything in L2, for the arithmetic's own rate.
// Prints the median of 31 repetitions (fresh random tables each) in GB/s of K and V read.
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
int main(int argc, char** argv) {
  const int pf = atoi(argv[1]), work = atoi(argv[2]), tasks = atoi(argv[3]), nb = atoi(argv[4]), dyn = atoi(argv[5]), one = atoi(argv[6]);
  const int64_t pool = (argc > 7 ? (int64_t)atoi(argv[7]) : 1024LL) << 20, blk = 24576, nblk = pool / blk;
  char* K = huge(pool); char* V = one ? K : huge(pool);
  std::mt19937 rng(1); std::vector<int> tab(tasks * nb);
  std::vector<double> ts;
  float dummy = 0;
  for (int r = 0; r < 31; ++r) {
    for (auto& t : tab) t = rng() % nblk;
    auto t0 = std::chrono::steady_clock::now();
    #pragma omp parallel reduction(+:dummy)
    {
      __m512 a[8]; for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
      auto block = [&](const char* p, const char* nx) {
        if (pf >= 200) {  // touch the block with plain loads first (the L2 streamer follows them), then compute from L1
          __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
          for (int64_t o = 0; o < blk; o += 256) {
            t0 = _mm512_or_ps(t0, _mm512_load_ps(p + o)); t1 = _mm512_or_ps(t1, _mm512_load_ps(p + o + 64));
            t2 = _mm512_or_ps(t2, _mm512_load_ps(p + o + 128)); t3 = _mm512_or_ps(t3, _mm512_load_ps(p + o + 192));
          }
          a[7] = _mm512_add_ps(a[7], _mm512_or_ps(_mm512_or_ps(t0, t1), _mm512_or_ps(t2, t3)));
          if (pf == 201 && nx) for (int l = 0; l < 4; ++l) _mm_prefetch(nx + 64 * l, _MM_HINT_T1);
        }
        for (int64_t o = 0; o < blk; o += 256) {
          if (pf >= 200) {} else if (pf >= 100 && nx) { for (int l = 0; l < 4; ++l) { const int64_t line = o / 64 + l; if (line % (pf - 100) == 0) a[7] = _mm512_add_ps(a[7], _mm512_load_ps(nx + 64 * line)); } } else if (pf && nx) for (int l = 0; l < 4; ++l) { const int64_t line = o / 64 + l; if (pf > 0 ? line % pf == 0 : (line % 64) < -pf) _mm_prefetch(nx + 64 * line, _MM_HINT_T1); }
          __m512 x0 = _mm512_load_ps(p + o), x1 = _mm512_load_ps(p + o + 64), x2 = _mm512_load_ps(p + o + 128), x3 = _mm512_load_ps(p + o + 192);
          a[0] = _mm512_add_ps(a[0], x0); a[1] = _mm512_add_ps(a[1], x1); a[2] = _mm512_add_ps(a[2], x2); a[3] = _mm512_add_ps(a[3], x3);
          for (int w = 0; w < work; ++w) {
            a[0] = _mm512_fmadd_ps(x0, x1, a[0]); a[1] = _mm512_fmadd_ps(x1, x2, a[1]); a[2] = _mm512_fmadd_ps(x2, x3, a[2]); a[3] = _mm512_fmadd_ps(x3, x0, a[3]);
            a[4] = _mm512_fmadd_ps(x0, x2, a[4]); a[5] = _mm512_fmadd_ps(x1, x3, a[5]); a[6] = _mm512_fmadd_ps(x2, x0, a[6]); a[7] = _mm512_fmadd_ps(x3, x1, a[7]);
          }
        }
      };
      if (dyn) {
        #pragma omp for schedule(dynamic, 4)
        for (int i = 0; i < tasks; ++i) {
          const int* t = tab.data() + i * nb;
          const char* nextk = i + 1 < tasks ? K + (int64_t)tab[(i + 1) * nb] * blk : nullptr;
          for (int b = 0; b < nb; ++b) block(K + (int64_t)t[b] * blk, b + 1 < nb ? K + (int64_t)t[b + 1] * blk : V + (int64_t)t[0] * blk);
          for (int b = 0; b < nb; ++b) block(V + (int64_t)t[b] * blk, b + 1 < nb ? V + (int64_t)t[b + 1] * blk : nextk);
        }
      } else {
        #pragma omp for schedule(static)
        for (int i = 0; i < tasks; ++i) {
          const int* t = tab.data() + i * nb;
          const char* nextk = i + 1 < tasks ? K + (int64_t)tab[(i + 1) * nb] * blk : nullptr;
          for (int b = 0; b < nb; ++b) block(K + (int64_t)t[b] * blk, b + 1 < nb ? K + (int64_t)t[b + 1] * blk : V + (int64_t)t[0] * blk);
          for (int b = 0; b < nb; ++b) block(V + (int64_t)t[b] * blk, b + 1 < nb ? V + (int64_t)t[b + 1] * blk : nextk);
        }
      }
      __m512 s = a[0]; for (int i = 1; i < 8; ++i) s = _mm512_add_ps(s, a[i]);
      dummy += _mm512_reduce_add_ps(s);
    }
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  printf("pf %d work %d tasks %d nb %d %s %s: median %.3f ms, %.1f GB/s (%g)\n", pf, work, tasks, nb, dyn ? "dynamic" : "static", one ? "one pool" : "two pools",
         ts[ts.size() / 2] * 1e3, 2.0 * tasks * nb * blk / ts[ts.size() / 2] / 1e9, dummy);
}
