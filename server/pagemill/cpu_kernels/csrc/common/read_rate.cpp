// A plain read of a buffer by a team of threads, each streaming its contiguous share with
// 64-byte loads: the read rate the benchmarks' memory floors use (bench/roofline.py).
//
// Why: the floors took torch's float32 sum over 4 KiB pages as the machine's read rate. On the
// 2-vCPU Xeon of docs/benchmarks.md that sum read 22.8 GB/s over 512 MiB, this loop 26.1, and the
// two 30.1 and 30.9 from huge pages (where the shard keeps its weights). Once the decode linears
// asked for their weights ahead (vec.h's ask_ahead), a batch-1 step read its ~270 MB faster than
// that "floor". A floor must be what no reader beats: roofline.py reads from huge pages and takes
// the faster of torch's sum and this loop.
#include <omp.h>
#include <stdint.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

extern "C" {

// The sum of the float32 values in bytes [0, bytes) of p (bytes a multiple of 4), each read
// once by one of `threads` threads (returned, so that the loads cannot be left out).
float pagemill_read(const void* p, int64_t bytes, int threads) {
  float total = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int64_t lines = bytes / 64, t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t l0 = lines * t / n, l1 = lines * (t + 1) / n;
    const char* q = (const char*)p;
#if defined(__AVX512F__)
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t l = l0;
    for (; l + 1 < l1; l += 2) {
      s0 = _mm512_add_ps(s0, _mm512_loadu_ps(q + 64 * l));
      s1 = _mm512_add_ps(s1, _mm512_loadu_ps(q + 64 * (l + 1)));
    }
    if (l < l1) s0 = _mm512_add_ps(s0, _mm512_loadu_ps(q + 64 * l));
    total += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#elif defined(__AVX2__)
    // Without AVX-512 the scalar loop below is one dependent add per 4 bytes: it read 1.8 GB/s
    // on the 2-core Zen 3 of the quant kernels' benchmark, where torch's sum read 6.5.
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t l = l0; l < l1; ++l) {
      s0 = _mm256_add_ps(s0, _mm256_loadu_ps((const float*)(q + 64 * l)));
      s1 = _mm256_add_ps(s1, _mm256_loadu_ps((const float*)(q + 64 * l + 32)));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(s0, s1));
    for (float v : lanes) total += v;
#else
    const float* f = (const float*)(q + 64 * l0);
    float s = 0.f;
    for (int64_t i = 0; i < (l1 - l0) * 16; ++i) s += f[i];
    total += s;
#endif
    if (t == n - 1)  // the floats after the last whole line
      for (int64_t i = lines * 16; i < bytes / 4; ++i) total += ((const float*)p)[i];
  }
  return total;
}
}
