// Paged attention of one kv head's query group against one sequence's cache:
// the inner loop of decode attention for the whole-layer kernel (decode.cpp)
// and for attend_batch's shapes that paged_attention_spans.h does not take;
// attend_batch (at the end) runs the batched steps.
//
// Why it is shaped this way (measured, docs/cpu.md): the plain loop spent
// most of its time outside the multiplies: a horizontal sum per (token,
// head) score, each bf16 key widened once per query head, a scalar expf per
// score, and every value row added into an output held in memory.
// Here, with AVX-512:
// - scores: 16 tokens at a time per head, one accumulator each, then one
//   transposing reduction turns the 16 accumulators into 16 scores (~3
//   shuffles per score instead of ~8). bf16 keys meet a bf16 copy of the
//   query in vdpbf16ps where the CPU has AVX512-BF16 (the query is rounded to
//   bf16 as torch's bf16 attention holds it; keys are used as stored);
//   otherwise keys are widened once per 16 elements and FMA'd in float32.
// - softmax: vectorised, exp by range reduction and a degree-6 polynomial
//   (relative error ~2e-7, below float32 rounding of the sums that follow);
//   the 1/sum is applied to the output, not to every probability.
// - values: each row widened once and FMA'd into the group's outputs held
//   in registers (up to 24 vectors), chunks of query heads when more.
// Without AVX-512 (or with a head_dim that is not a multiple of 16) the
// scalar loop below runs; both compute softmax(scale * q.K^T) V in float32.
//
// int8 caches (--kv-cache-dtype int8, attention/kv_dtype.py): each row of
// head_dim entries is followed by its float32 scale (a row of D + 4 bytes).
// The kernel widens the int8 entries like bf16 ones and applies the scales
// where they cost least: a key's scale multiplies its finished score (one
// multiply per token, not per entry), a value's scale is folded into the
// token's probabilities before the value pass (once per (token, head)).
#pragma once
#include <omp.h>
#include <stdint.h>

#include "attention/attend_group.h"
#include "attention/paged_attention_spans.h"  // attend_batch's path for the shapes it takes

namespace pagemill {

// Attention of B single-token queries against their paged caches: for the
// head sizes paged_attention_spans.h takes (AVX-512), one task per (sequence,
// span of its keys) over all heads, else one per (sequence, kv head) through
// attend_group. q [B, nh, D] (token b's heads at q + b * q_stride),
// out [B, nh, D] of T (float or bf16; arithmetic in float32), caches of C
// (T, fp8 or int8 rows); block_tables [B, width]; window > 0: each query sees
// only its last `window` keys. Used by decode.cpp and paged_attention_int8.cpp.
// Small steps run on the calling thread: a parallel region's barrier costs
// more than the work, and far more when the cores are shared (a descheduled
// thread stalls the others; measured: a 2-layer test model decoding 12
// sequences went from 29 to 70 ms a step under load).
constexpr int64_t kAttendParallelWork = 1 << 20;

// Whether a decode step's attention takes the threads (keys x heads x head_dim against
// kAttendParallelWork); also how the spans are cut, so every caller cutting them must ask here.
inline bool attend_takes_threads(const int32_t* context_lens, int64_t B, int64_t nh, int64_t D) {
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += context_lens[b] > 0 ? context_lens[b] : 0;
  return work * nh * D >= kAttendParallelWork;
}

template <typename T, typename C>
int attend_batch(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache, const int32_t* block_tables,
                 int64_t width, const int32_t* context_lens, T* out, int64_t B, int64_t nh, int64_t nkv, int64_t D,
                 int64_t bs, float scale, int64_t window, int threads) {
  if (nkv <= 0 || nh % nkv != 0) return 1;
  const int64_t group = nh / nkv;
  const bool parallel = attend_takes_threads(context_lens, B, nh, D);
#if defined(__AVX512F__)
  if (spans_apply<C>(D, group)) {
    switch (D / 16) {
#define PAGEMILL_SPANS_NV(nv)                                                                                    \
  case nv:                                                                                                       \
    attend_batch_spans<nv>(q, q_stride, k_cache, v_cache, block_tables, width, context_lens, out, B, nh, nkv, bs, \
                           scale, window, threads, parallel);                                                    \
    return 0;
      PAGEMILL_SPANS_NV(2) PAGEMILL_SPANS_NV(4) PAGEMILL_SPANS_NV(5)
      PAGEMILL_SPANS_NV(6) PAGEMILL_SPANS_NV(8) PAGEMILL_SPANS_NV(16)
#undef PAGEMILL_SPANS_NV
      default: break;
    }
  }
#endif
#pragma omp parallel num_threads(threads) if (parallel)
  {
    std::vector<float> scores, qf(group * D), of(group * D);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < nkv; ++j) {
        const int64_t len = context_lens[b];
        const T* qg = q + b * q_stride + j * group * D;
        T* o = out + (b * nh + j * group) * D;
        if (len <= 0) {
          memset((void*)o, 0, group * D * sizeof(T));
          continue;
        }
        const int64_t first = first_key(len, window);
        scores.resize(group * (len - first));
        const PagedKV<C> kv{k_cache, v_cache, block_tables + b * width, bs, nkv, D};
        if constexpr (std::is_same_v<T, float>) {
          attend_group(qg, D, group, kv, j, first, len, scale, scores.data(), o, D);
        } else {  // widen this group's queries, narrow its outputs
          for (int64_t i = 0; i < group * D; ++i) qf[i] = to_float(qg[i]);
          attend_group(qf.data(), D, group, kv, j, first, len, scale, scores.data(), of.data(), D);
          for (int64_t i = 0; i < group * D; ++i) o[i] = from_float<T>(of[i]);
        }
      }
    }
  }
  return 0;
}

}  // namespace pagemill
