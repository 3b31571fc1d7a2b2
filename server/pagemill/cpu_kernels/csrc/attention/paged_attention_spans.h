// Decode attention of one sequence's span of keys for ALL its query heads,
// block by block (attend_batch's AVX-512 path; included by paged_attention.h,
// whose helpers it uses).
//
// Why (measured, docs/cpu.md): at 64 running sequences the kernel waited on
// memory. The pool is [blocks, block_size, kv_heads, head_dim], so a task per
// (sequence, kv head) read 1 of every kv_heads rows of each block, and the
// kv_heads tasks of a sequence read the same blocks at different times. Here a
// task reads each block's K and V once, front to back (6 KB each at the
// default model's shape), for every kv head, and asks for the blocks ahead of
// it (scattered over the pool: no hardware prefetcher finds them).
// A span is any run of blocks, taken in two passes (scores, then values;
// attend_span says why): attend_batch_spans splits long contexts over tasks
// when there are too few sequences to go round, and merges the spans' partial
// results (max, sum and output per head).
#pragma once
#include "attention/attend_group.h"  // the per-group helpers it shares

namespace pagemill {

#if defined(__AVX512F__)

// Where a head's softmax over a span stands when the span is done: max,
// sum of e^(s - max), and the unnormalised output (for bf16 caches in
// widen_values' order); spans of one sequence are merged from these.
struct HeadState {
  float* m;
  float* l;
  float* acc;  // [heads][D]
};

// Lines of one cache's next block, spread over the rows of a pass, into L2.
// Measured (benchmarks/decode_attention.py, 64 x 192, one thread): a burst
// of a block's ~200 prefetches at the block's start stalled on the full miss
// queue (`perf annotate`: a quarter of the samples on the prefetches), 0.72x
// the per-kv-head kernel; spread out, into L1, 0.9x (the value loads still
// waited: two blocks ahead do not fit L1 beside the block in use); into L2,
// one block ahead, 1.4x (two or four ahead: less; _MM_HINT_T2 the same as T1).
struct Ahead {
  const char* p;
  int64_t lines;

  inline void at(int64_t i, int64_t n) const {  // row i of n's share
    for (int64_t x = i * lines / n; x < (i + 1) * lines / n; ++x) _mm_prefetch(p + 64 * x, _MM_HINT_T1);
  }
  // Chunk `c` of a block (rows [r0, r0 + n) of `stride` entries of C), kv head j of nkv's share.
  template <typename C>
  static Ahead share(const C* cache, int64_t block_row, int64_t r0, int64_t n, int64_t stride, int64_t j,
                     int64_t nkv) {
    if (block_row < 0) return {nullptr, 0};
    const int64_t from = (block_row + r0 * stride) * (int64_t)sizeof(C);
    const int64_t lines = (n * stride * (int64_t)sizeof(C) + 63) / 64;
    const int64_t l0 = j * lines / nkv, l1 = (j + 1) * lines / nkv;
    return {(const char*)cache + from + 64 * l0, l1 - l0};
  }
};

// acc[g] += sum_i p[g][i] v_i over the n rows of a chunk, heads g < G.
template <int NV, int G, typename C>
inline void chunk_values(const float* p, int64_t n, const C* v0, int64_t stride, float* acc, const Ahead& ahead) {
  __m512 o[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) o[g][c] = _mm512_loadu_ps(acc + (g * NV + c) * 16);
  for (int64_t i = 0; i < n; ++i) {
    ahead.at(i, n);
    __m512 vf[NV];
    widen_values<NV>(v0 + i * stride, vf);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * 16 + i]);
      for (int c = 0; c < NV; ++c) o[g][c] = _mm512_fmadd_ps(pg, vf[c], o[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (g * NV + c) * 16, o[g][c]);
}

// chunk_values for `group` heads in the even passes of value_passes().
template <int NV, typename C>
inline void chunk_values_group(const float* p, int64_t group, int64_t n, const C* v0, int64_t stride, float* acc,
                               const Ahead& ahead) {
  const int64_t passes = value_passes(group, kMaxG<NV>);
  for (int64_t i = 0, g = 0; i < passes; ++i) {
    const int64_t G = (group - g) / (passes - i);
    const float* pg = p + g * 16;
    float* ag = acc + g * 16 * NV;
    switch (G) {  // G <= kMaxG<NV>
#define PAGEMILL_CHUNK_G(k) \
  case k:                   \
    if constexpr (kMaxG<NV> >= k) chunk_values<NV, k>(pg, n, v0, stride, ag, i ? Ahead{nullptr, 0} : ahead); \
    break;
      PAGEMILL_CHUNK_G(1) PAGEMILL_CHUNK_G(2) PAGEMILL_CHUNK_G(3)
      PAGEMILL_CHUNK_G(4) PAGEMILL_CHUNK_G(5) PAGEMILL_CHUNK_G(6)
#undef PAGEMILL_CHUNK_G
      default: break;
    }
    g += G;
  }
}

template <typename C, int kHint = _MM_HINT_T0>
inline void prefetch_bytes(const C* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)p + b, (_mm_hint)kHint);
}

// Where a span's chunks of <= 16 tokens lie: block by block, each chunk's
// first token c0, row count n and first cache row (of `stride` entries).
template <typename C, typename F>
inline void for_chunks(const PagedKV<C>& kv, int64_t t0, int64_t t1, F&& chunk) {
  const int64_t bs = kv.block_size, stride = kv.kv_heads * kv.pitch();
  const int64_t b0 = t0 / bs, b1 = (t1 - 1) / bs + 1;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = (int64_t)kv.block_table[b] * bs * stride;
    const int64_t first = b * bs > t0 ? b * bs : t0, end = (b + 1) * bs < t1 ? (b + 1) * bs : t1;
    for (int64_t c0 = first; c0 < end; c0 += 16) {
      const int64_t n = end - c0 < 16 ? end - c0 : 16;
      chunk(b, c0, n, base + (c0 % bs) * stride);
    }
  }
}

// The heads of one sequence over its keys [t0, t1) (t0 < t1), into st (which
// must start at m = -inf, l = 0, acc = 0), in two passes over the span: the
// scores of every key (the K blocks front to back) into `scores` (heads x
// ld floats, ld >= t1 - t0 + 16), one softmax per head, then the values (the
// V blocks front to back). Why two passes and not an online softmax:
// measured, the online one's per-chunk max, rescale and sums (horizontal
// reductions and a scalar exp in a dependent chain, per head and 16 keys)
// took a third of the kernel's time while it was compute-bound (one thread,
// ~9 GB/s against ~20 GB/s for the same loads and prefetches without them).
// Each pass asks for its next block along the way (Ahead), the scores pass
// for the span's first V block as it ends and the values pass for the next
// task's first K block (`next`, presumably this thread's next span; cold: no
// span before this one on this thread asked for its first block).
template <int NV, typename C>
inline void attend_span(const QueryRow<C>* q, const PagedKV<C>& kv, int64_t group, int64_t t0, int64_t t1,
                        float scale, bool cold, const int32_t* next, HeadState st, float* scores, int64_t ld) {
  constexpr int64_t D = 16 * NV;
  const int64_t bs = kv.block_size, nkv = kv.kv_heads, P = kv.pitch(), stride = nkv * P, len = t1 - t0;
  const int64_t b0 = t0 / bs, b1 = (t1 - 1) / bs + 1, block_rows = bs * stride;
  if (cold) prefetch_bytes(kv.k + (int64_t)kv.block_table[b0] * block_rows, block_rows * (int64_t)sizeof(C));
  // Pass 1: scores.
  for_chunks(kv, t0, t1, [&](int64_t b, int64_t c0, int64_t n, int64_t row0) {
    const __mmask16 valid = pagemill::first(n);
    // The next K block, or this span's first V block after the last K block.
    const C* ahead_cache = b + 1 < b1 ? kv.k : kv.v;
    const int64_t ahead_row = (int64_t)kv.block_table[b + 1 < b1 ? b + 1 : b0] * block_rows;
    for (int64_t j = 0; j < nkv; ++j) {
      const C* k0 = kv.k + row0 + j * P;
      const Ahead ahead = Ahead::share(ahead_cache, ahead_row, c0 % bs, n, stride, j, nkv);
      __m512 chunk_sc = _mm512_set1_ps(scale);
      if constexpr (kScaled<C>) {  // a key's scale on its score
        alignas(64) float ks[16] = {};
        for (int64_t i = 0; i < n; ++i) ks[i] = row_scale(k0 + i * stride, D);
        chunk_sc = _mm512_mul_ps(chunk_sc, _mm512_load_ps(ks));
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = j * group + g;
        ahead.at(g, group);
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; ++i) acc[i] = qk_partial(q[h], k0 + i * stride, D, acc[i]);
        _mm512_mask_storeu_ps(scores + h * ld + (c0 - t0), valid, _mm512_mul_ps(transpose_sum16(acc), chunk_sc));
      }
    }
  });
  for (int64_t h = 0; h < nkv * group; ++h) st.l[h] = exp_shifted(scores + h * ld, len, st.m + h);
  // Pass 2: values.
  alignas(64) float p[64 * 16];
  for_chunks(kv, t0, t1, [&](int64_t b, int64_t c0, int64_t n, int64_t row0) {
    // The next V block, or the next task's first K block after the last V block.
    const int64_t ahead_row = b + 1 < b1 ? (int64_t)kv.block_table[b + 1] * block_rows
                                         : (next ? (int64_t)*next * block_rows : -1);
    const C* ahead_cache = b + 1 < b1 ? kv.v : kv.k;
    for (int64_t j = 0; j < nkv; ++j) {
      const C* v0 = kv.v + row0 + j * P;
      for (int64_t g = 0; g < group; ++g) {
        const float* e = scores + (j * group + g) * ld + (c0 - t0);
        for (int64_t i = 0; i < n; ++i) p[g * 16 + i] = e[i];
      }
      if constexpr (kScaled<C>) {  // a value's scale on its probabilities (after the sums above)
        for (int64_t i = 0; i < n; ++i) {
          const float vs = row_scale(v0 + i * stride, D);
          for (int64_t g = 0; g < group; ++g) p[g * 16 + i] *= vs;
        }
      }
      chunk_values_group<NV>(p, group, n, v0, stride, st.acc + j * group * D,
                             Ahead::share(ahead_cache, ahead_row, c0 % bs, n, stride, j, nkv));
    }
  });
}

// The blocks of each of `spans` spans of one sequence's keys [first, len)
// (whole blocks each, from first's block; the last spans shorter or empty).
inline int64_t span_blocks(int64_t first, int64_t len, int64_t bs, int64_t spans) {
  const int64_t blocks = (len - 1) / bs - first / bs + 1;
  return (blocks + spans - 1) / spans;
}

// How many spans each sequence's keys are cut into: 1 while the sequences
// alone give every thread a few tasks; else enough that they do, no span
// shorter than kMinSpanTokens (a span's merge and its prefetch ramp cost more).
constexpr int64_t kMinSpanTokens = 64;
inline int64_t spans_per_sequence(int64_t B, int64_t max_len, int threads) {
  if (threads <= 1 || B >= 4 * (int64_t)threads) return 1;
  const int64_t want = (4 * threads + B - 1) / B, most = max_len / kMinSpanTokens;
  return want < most ? want : (most > 1 ? most : 1);
}

// Whether attend_batch_spans takes this shape (else the per-kv-head path).
template <typename C>
inline bool spans_apply(int64_t D, int64_t group) {
  const int64_t nv = D / 16;
  if (D % 16 != 0 || group > 64 || (QueryRow<C>::kDp && D % 32 != 0)) return false;
  return nv == 2 || nv == 4 || nv == 5 || nv == 6 || nv == 8 || nv == 16;
}

// How many consecutive tasks a thread takes at a time: runs of them, so that a
// task's prefetch of the next one's first block (attend_span's `next`) is
// mostly right, and still about 8 grabs a thread to even out the threads (a
// shared core stalls one now and then).
inline int64_t tasks_per_grab(int64_t tasks, int threads) {
  const int64_t n = tasks / (8 * (int64_t)(threads > 0 ? threads : 1));
  return n > 1 ? n : 1;
}

// Task i's keys: sequence b, [t0, t1) (t0 >= t1: none), for `spans` spans per sequence.
struct Span {
  int64_t b, t0, t1;
};
inline Span span_of(int64_t i, int64_t spans, const int32_t* lens, int64_t bs, int64_t window) {
  const int64_t b = i / spans, s = i % spans, len = lens[b];
  if (len <= 0) return {b, 0, 0};
  const int64_t first = first_key(len, window), per = span_blocks(first, len, bs, spans) * bs;
  const int64_t lo = (first / bs) * bs + s * per, hi = lo + per;
  return {b, lo > first ? lo : first, hi < len ? hi : len};
}

// out[h] = acc[h] / l[h] in the cache order's inverse, narrowed to T.
template <int NV, typename C, typename T>
inline void finish_head(const float* acc, float l, T* out) {
  alignas(64) float o[16 * NV];
  __m512 r[NV];
  for (int c = 0; c < NV; ++c) r[c] = _mm512_loadu_ps(acc + 16 * c);
  store_values<NV, C>(r, _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f), o);
  for (int64_t d = 0; d < 16 * NV; ++d) out[d] = from_float<T>(o[d]);
}

// How attend_batch_spans cuts a step: `spans` per sequence, `grab` tasks at a
// time, and the floats of merge scratch it needs (0 with one span).
struct SpanPlan {
  int64_t spans, tasks, grab, part;
  int64_t parts_floats() const { return spans > 1 ? tasks * part : 0; }
};
inline SpanPlan plan_spans(const int32_t* lens, int64_t B, int64_t nh, int64_t D, int threads) {
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = lens[b] > max_len ? lens[b] : max_len;
  const int64_t spans = spans_per_sequence(B, max_len, threads), tasks = B * spans;
  return {spans, tasks, tasks_per_grab(tasks, threads), nh * (D + 2)};
}

// The tasks of a SpanPlan: one per (sequence, span). An orphaned `omp for`:
// inside a parallel region the team shares them (and ends on its barrier),
// outside one the calling thread runs them all. With one span per sequence
// each task writes its heads' outputs; else its state goes to `parts` for
// merge_spans.
template <int NV, typename T, typename C>
void span_tasks(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache, const int32_t* block_tables,
                int64_t width, const int32_t* lens, T* out, int64_t nh, int64_t nkv, int64_t bs, float scale,
                int64_t window, const SpanPlan& plan, float* parts) {
  constexpr int64_t D = 16 * NV;
  const int64_t group = nh / nkv, spans = plan.spans, tasks = plan.tasks, part = plan.part;
  std::vector<QueryRow<C>> qr(nh);
  std::vector<float> qf(nh * D), own(part), scores;
  int64_t last = -2;  // the task this thread ran before
#pragma omp for schedule(dynamic, plan.grab)
  for (int64_t i = 0; i < tasks; ++i) {
    const bool cold = i != last + 1;
    last = i;
    const Span sp = span_of(i, spans, lens, bs, window);
    float* st = spans > 1 ? parts + i * part : own.data();
    const HeadState hs{st, st + nh, st + 2 * nh};
    for (int64_t h = 0; h < nh; ++h) hs.m[h] = -INFINITY, hs.l[h] = 0.f;
    memset(hs.acc, 0, nh * D * sizeof(float));
    if (sp.t0 < sp.t1) {
      const T* qb = q + sp.b * q_stride;
      for (int64_t x = 0; x < nh * D; ++x) qf[x] = to_float(qb[x]);
      for (int64_t h = 0; h < nh; ++h) {
        if constexpr (QueryRow<C>::kDp) {
#if defined(__AVX512BF16__)
          const float* qh = qf.data() + h * D;
          for (int64_t c = 0; c < D / 32; ++c)
            qr[h].q[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qh + 32 * c + 16), _mm512_loadu_ps(qh + 32 * c));
#endif
        } else {
          qr[h].q = qf.data() + h * D;
        }
      }
      const Span nx = i + 1 < tasks ? span_of(i + 1, spans, lens, bs, window) : Span{0, 0, 0};
      const int32_t* next = nx.t0 < nx.t1 ? block_tables + nx.b * width + nx.t0 / bs : nullptr;
      const PagedKV<C> kv{k_cache, v_cache, block_tables + sp.b * width, bs, nkv, D};
      const int64_t ld = sp.t1 - sp.t0 + 16;
      scores.resize(nh * ld);
      attend_span<NV>(qr.data(), kv, group, sp.t0, sp.t1, scale, cold, next, hs, scores.data(), ld);
    }
    if (spans == 1)
      for (int64_t h = 0; h < nh; ++h) finish_head<NV, C>(hs.acc + h * D, hs.l[h], out + (sp.b * nh + h) * D);
  }
}

// Each sequence's spans merged into its outputs: rescaled to the largest max,
// added. An orphaned `omp for` over (sequence, head), after span_tasks.
template <int NV, typename C, typename T>
void merge_spans(const float* parts, T* out, int64_t B, int64_t nh, const SpanPlan& plan) {
  constexpr int64_t D = 16 * NV;
  const int64_t spans = plan.spans, part = plan.part;
  float acc[D];
#pragma omp for schedule(static)
  for (int64_t bh = 0; bh < B * nh; ++bh) {
    const int64_t b = bh / nh, h = bh % nh;
    float m = -INFINITY, l = 0.f;
    for (int64_t s = 0; s < spans; ++s) {
      const float ms = parts[(b * spans + s) * part + h];
      m = ms > m ? ms : m;
    }
    for (int64_t x = 0; x < D; ++x) acc[x] = 0.f;
    if (m > -INFINITY) {
      for (int64_t s = 0; s < spans; ++s) {
        const float* st = parts + (b * spans + s) * part;
        if (st[nh + h] == 0.f) continue;
        const float w = expf(st[h] - m);
        l += st[nh + h] * w;
        for (int64_t x = 0; x < D; ++x) acc[x] += st[2 * nh + h * D + x] * w;
      }
    }
    finish_head<NV, C>(acc, l, out + (b * nh + h) * D);
  }
}

// Both, called by every thread of the caller's parallel region with the same
// arguments: the team's attention inside a layer that is one region
// (decode.cpp, decode_batched.cpp). parts: plan.parts_floats() floats shared
// by the team. False (nothing computed) for a head size spans do not take;
// spans_apply(D, group) rules that out.
template <typename T, typename C>
bool attend_spans_in_region(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache,
                            const int32_t* block_tables, int64_t width, const int32_t* lens, T* out, int64_t B,
                            int64_t nh, int64_t nkv, int64_t D, int64_t bs, float scale, int64_t window,
                            const SpanPlan& plan, float* parts) {
  switch (D / 16) {
#define PAGEMILL_SPANS_REGION(nv)                                                                             \
  case nv:                                                                                                    \
    span_tasks<nv>(q, q_stride, k_cache, v_cache, block_tables, width, lens, out, nh, nkv, bs, scale, window, \
                   plan, parts);                                                                              \
    if (plan.spans > 1) merge_spans<nv, C>(parts, out, B, nh, plan);                                          \
    return true;
    PAGEMILL_SPANS_REGION(2) PAGEMILL_SPANS_REGION(4) PAGEMILL_SPANS_REGION(5)
    PAGEMILL_SPANS_REGION(6) PAGEMILL_SPANS_REGION(8) PAGEMILL_SPANS_REGION(16)
#undef PAGEMILL_SPANS_REGION
    default:
      return false;
  }
}

// attend_batch (paged_attention.h) by spans of all heads: one task per
// (sequence, span), the spans merged when a sequence has more than one.
template <int NV, typename T, typename C>
void attend_batch_spans(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache, const int32_t* block_tables,
                        int64_t width, const int32_t* lens, T* out, int64_t B, int64_t nh, int64_t nkv, int64_t bs,
                        float scale, int64_t window, int threads, bool parallel) {
  const SpanPlan plan = plan_spans(lens, B, nh, 16 * NV, parallel ? threads : 1);
  // Each span's state when there are several: [task][heads] of (m, l, acc[D]).
  static thread_local std::vector<float> parts;
  parts.resize(plan.parts_floats());
  float* const parts_data = parts.data();
#pragma omp parallel num_threads(threads) if (parallel)
  {
    span_tasks<NV>(q, q_stride, k_cache, v_cache, block_tables, width, lens, out, nh, nkv, bs, scale, window, plan,
                   parts_data);
    if (plan.spans > 1) merge_spans<NV, C>(parts_data, out, B, nh, plan);
  }
}

#endif  // __AVX512F__

}  // namespace pagemill
