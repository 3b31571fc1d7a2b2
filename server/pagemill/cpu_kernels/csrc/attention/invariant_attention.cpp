// Paged attention whose every output is summed in one fixed order (--batch-invariant): new
// token t of sequence seq[t] at absolute position pos[t] attends to its sequence's keys
// max(0, pos - window + 1) .. pos, read through the block table, one (token, head) per task.
//
// Why not paged_attention / prefill_attention: they split a long context over threads when
// there are few sequences and tile prompt queries by the chunk's length, so the order of a
// row's sums depends on what shares the step and on how the prompt was chunked. Here a
// score is a fixed-order dot (common/fixed_order.h), the softmax runs over keys in
// increasing position, and each output lane sums its values in increasing position too:
// the bits depend on the token's own keys alone, prompt row or decode row alike.
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "common/fixed_order.h"
#include "common/vec.h"

namespace {

using pagemill::bf16;
using pagemill::fp8e4m3;
using pagemill::fp8e5m2;
namespace fx = pagemill::fixed;

// Below this many key reads (token x head x key) one thread does it all: a decode step's
// attention is small, and on a busy machine each parallel region's barrier waits for a
// descheduled thread (as invariant_gemm.cpp's kParallelWork).
constexpr int64_t kParallelKeys = int64_t(1) << 16;

struct Shape {
  int64_t tokens, heads, kv_heads, head_dim, block_size, table_width;
};

template <class Q, class KV>
void run(const Q* q, const KV* k_cache, const KV* v_cache, const int32_t* tables, const int64_t* seq,
         const int64_t* pos, Shape s, float scale, int64_t window, float softcap, Q* out, int threads) {
  const int64_t group = s.heads / s.kv_heads, D = s.head_dim;
  int64_t keys = 0;
  for (int64_t t = 0; t < s.tokens; ++t) keys += (pos[t] + 1) * s.heads;
  if (keys < kParallelKeys) threads = 1;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> qf(D), scores, acc(D);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < s.tokens * s.heads; ++task) {
      const int64_t t = task / s.heads, h = task % s.heads, kvh = h / group;
      const int32_t* table = tables + seq[t] * s.table_width;
      const int64_t last = pos[t], first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      for (int64_t d = 0; d < D; ++d) qf[d] = pagemill::to_float(q[(t * s.heads + h) * D + d]);
      scores.resize(last - first + 1);
      float top = -INFINITY;
      for (int64_t p = first; p <= last; ++p) {
        const int64_t slot = (int64_t)table[p / s.block_size] * s.block_size + p % s.block_size;
        float score = fx::dot(qf.data(), k_cache + (slot * s.kv_heads + kvh) * D, D) * scale;
        if (softcap > 0.f) score = tanhf(score / softcap) * softcap;
        scores[p - first] = score;
        top = std::max(top, score);
      }
      float total = 0.f;
      for (float& e : scores) {
        e = expf(e - top);
        total += e;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = first; p <= last; ++p) {
        const int64_t slot = (int64_t)table[p / s.block_size] * s.block_size + p % s.block_size;
        const KV* v = v_cache + (slot * s.kv_heads + kvh) * D;
        const float e = scores[p - first];
        for (int64_t d = 0; d < D; ++d) acc[d] = fmaf(e, pagemill::to_float(v[d]), acc[d]);
      }
      Q* o = out + (t * s.heads + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = pagemill::from_float<Q>(acc[d] / total);
    }
  }
}

template <class Q>
int by_cache(int kv_dtype, const Q* q, const void* k, const void* v, const int32_t* tables, const int64_t* seq,
             const int64_t* pos, Shape s, float scale, int64_t window, float softcap, Q* out, int threads) {
  switch (kv_dtype) {
    case 0: run(q, (const float*)k, (const float*)v, tables, seq, pos, s, scale, window, softcap, out, threads); return 0;
    case 1: run(q, (const bf16*)k, (const bf16*)v, tables, seq, pos, s, scale, window, softcap, out, threads); return 0;
    case 2: run(q, (const fp8e4m3*)k, (const fp8e4m3*)v, tables, seq, pos, s, scale, window, softcap, out, threads); return 0;
    case 3: run(q, (const fp8e5m2*)k, (const fp8e5m2*)v, tables, seq, pos, s, scale, window, softcap, out, threads); return 0;
    default: return 1;
  }
}

}  // namespace

extern "C" {

// q, out [tokens, heads, head_dim] (q_dtype: 0 float32, 1 bfloat16); caches [slots, kv_heads,
// head_dim] (kv_dtype: 0 float32, 1 bfloat16, 2 fp8 e4m3, 3 fp8 e5m2); tables [seqs,
// table_width] int32; seq, pos [tokens] int64. window <= 0: none; softcap <= 0: none.
// Returns 0, or 1 for an unknown dtype.
int pagemill_invariant_attention(const void* q, const void* k_cache, const void* v_cache, const int32_t* tables,
                                 const int64_t* seq, const int64_t* pos, int64_t tokens, int64_t heads,
                                 int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t table_width,
                                 float scale, int64_t window, float softcap, void* out, int q_dtype, int kv_dtype,
                                 int threads) {
  const Shape s{tokens, heads, kv_heads, head_dim, block_size, table_width};
  if (q_dtype == 0)
    return by_cache(kv_dtype, (const float*)q, k_cache, v_cache, tables, seq, pos, s, scale, window, softcap,
                    (float*)out, threads);
  if (q_dtype == 1)
    return by_cache(kv_dtype, (const bf16*)q, k_cache, v_cache, tables, seq, pos, s, scale, window, softcap,
                    (bf16*)out, threads);
  return 1;
}
}
