// Paged attention of prompt chunks (prefill), float32 or bfloat16 pools: a
// TILE of a sequence's new tokens x the query heads of one kv head against the
// sequence's cache, streamed once per tile.
//
// Why: the decode kernel (paged_attention.h) took every new token as its own
// one-row query, so each key and value row of a 256-token prompt was read and
// widened ~128 times and every score was a dot product of one query. Here a
// tile of up to kPrefillRows query rows (tokens x group) meets each chunk of
// 16 keys once, in row groups of 16 rows (the vector lanes; the queries are
// transposed once per tile):
// - scores: per key, its entries broadcast against the row group's query
//   columns: D/2 vdpbf16ps on bf16 pairs (bf16 with AVX512-BF16, query and
//   keys as stored, float32 sums) or D FMAs in float32 (float32, and bf16
//   without AVX512-BF16 over the chunk widened once); no horizontal sums.
// - softmax: online (flash-style) in float32, 16 rows at once: a running max m
//   and sum l per lane; the output is rescaled by e^(m_old - m_new).
// - values: P.V into float32 accumulators in registers for a few rows at a
//   time: with AVX512-BF16, P as bf16 pairs of keys against pairs of value rows
//   interleaved once per chunk (vdpbf16ps; torch's bf16 attention rounds P to
//   bf16 too), else FMA over the chunk widened to float32.
// Causal inside the chunk (new token i at position cached + i sees keys
// 0..cached + i) and the sliding window (key > query - window) are per-row
// key ranges; a tile streams from its first row's first key to its last
// row's position, and a row group skips the chunks none of its rows sees.
// With AMX-BF16 (bf16, head size 64, 128 or 256) both products run on tiles and
// the softmax is updated once a block of four chunks (prefill_tile_amx.h).
// One-token tiles (decode rows of a mixed step) go through the decode kernel
// (attend_group). Without AVX-512 (or a head_dim prefill_tile does not dispatch:
// not 16..128 in steps of 16, 160, 192 or 256) a scalar loop computes the same
// thing, one row at a time.
#pragma once
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "attention/paged_attention.h"
#include "attention/prefill_tile.h"
#include "attention/prefill_tile_amx.h"

namespace pagemill {

// A tile of one token (a decode row in a mixed step, or a one-token chunk): its
// `group` rows would fill a row group of 16 lanes mostly with padding, so they go
// through the decode kernel (paged_attention.h's attend_group) as before.
template <typename T>
void prefill_token(const PrefillTile<T>& t, const PagedKV<T>& kv, PrefillScratch& w) {
  const int64_t D = kv.head_dim, rows = t.group * D, len = t.cached + t.i0 + 1, lo = first_key(len, t.window);
  w.q.resize(2 * rows);
  w.s.resize(t.group * (len - lo));
  float *qf = w.q.data(), *of = qf + rows;
  const T* q = t.q + t.i0 * t.q_stride;  // the group's heads, D apart
  for (int64_t i = 0; i < rows; ++i) qf[i] = to_float(q[i]);
  attend_group(qf, D, t.group, kv, t.kv_head, lo, len, t.scale, w.s.data(), of, D);
  T* out = t.out + t.i0 * t.out_stride;
  for (int64_t i = 0; i < rows; ++i) out[i] = from_float<T>(of[i]);
}

// Whether bf16 tiles of head size D go to prefill_tile_avx512's AMX form (the head sizes
// dispatched below).
inline bool prefill_takes_amx(int64_t D) {
#if defined(PAGEMILL_AMX_ATTENTION)
  return kPrefillDp<bf16> && (D == 64 || D == 128 || D == 256) && amx::permitted();
#else
  (void)D;
  return false;
#endif
}

template <typename T>
void prefill_tile(const PrefillTile<T>& t, const PagedKV<T>& kv, PrefillScratch& w) {
  if (t.i1 - t.i0 == 1 && t.group < 8) return prefill_token(t, kv, w);
#if defined(PAGEMILL_AMX_ATTENTION)
  if constexpr (kPrefillDp<T>) {
    if (prefill_takes_amx(kv.head_dim)) {
      switch (kv.head_dim / 32) {
        case 2: return prefill_tile_amx<4>(t, kv, w);
        case 4: return prefill_tile_amx<8>(t, kv, w);
        case 8: return prefill_tile_amx<16>(t, kv, w);
        default: break;
      }
    }
  }
#endif
#if defined(__AVX512F__)
  if (kv.head_dim % 16 == 0) {
    switch (kv.head_dim / 16) {
#define PAGEMILL_PREFILL_NV(nv) \
  case nv:                      \
    return prefill_tile_avx512<T, nv>(t, kv, w);
      PAGEMILL_PREFILL_NV(1) PAGEMILL_PREFILL_NV(2) PAGEMILL_PREFILL_NV(3) PAGEMILL_PREFILL_NV(4)
      PAGEMILL_PREFILL_NV(5) PAGEMILL_PREFILL_NV(6) PAGEMILL_PREFILL_NV(7) PAGEMILL_PREFILL_NV(8)
      PAGEMILL_PREFILL_NV(10) PAGEMILL_PREFILL_NV(12) PAGEMILL_PREFILL_NV(16)
#undef PAGEMILL_PREFILL_NV
      default: break;
    }
  }
#endif
  prefill_tile_scalar(t, kv, w);
}

// A task: tokens i0..i1-1 of sequence `seq`; work ~ its keys x rows, for ordering.
struct PrefillTask {
  int64_t seq, i0, i1, work;
};

// Attention of a step's prompt chunks against their paged caches: sequence b's
// new tokens are rows cu_q[b]..cu_q[b+1]-1 of q [T, nh, D] (tokens q_stride
// apart) and out [T, nh, D]; its cache holds kv_lens[b] keys, the new ones
// last (written before this call). One task per (query tile, kv head), the
// longest first. Small steps run on the calling thread (attend_batch's rule).
template <typename T>
int prefill_batch(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                  int64_t width, const int32_t* cu_q, const int32_t* kv_lens, T* out, int64_t B, int64_t nh,
                  int64_t nkv, int64_t D, int64_t bs, float scale, int64_t window, int threads) {
  if (nkv <= 0 || nh % nkv != 0) return 1;
  const int64_t group = nh / nkv, tile = std::max<int64_t>(1, kPrefillRows / group);
  std::vector<PrefillTask> tasks;
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = cu_q[b + 1] - cu_q[b], cached = kv_lens[b] - n;
    if (n <= 0) continue;
    if (cached < 0) return 2;
    const int64_t tiles = (n + tile - 1) / tile, size = (n + tiles - 1) / tiles;  // even tiles
    for (int64_t i0 = 0; i0 < n; i0 += size) {
      const int64_t i1 = std::min(n, i0 + size);
      const int64_t keys = cached + i1 - first_key(cached + i0 + 1, window);
      tasks.push_back({b, i0, i1, keys * (i1 - i0)});
      work += keys * (i1 - i0);
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const PrefillTask& a, const PrefillTask& b) { return a.work > b.work; });
  const int64_t num_tasks = (int64_t)tasks.size();
  const bool parallel = work * nh * D >= kAttendParallelWork;
#pragma omp parallel num_threads(threads) if (parallel)
  {
    PrefillScratch w;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t k = 0; k < num_tasks; ++k) {
      for (int64_t j = 0; j < nkv; ++j) {
        const PrefillTask& task = tasks[k];
        const int64_t start = cu_q[task.seq], n = cu_q[task.seq + 1] - start;
        const PrefillTile<T> t{q + start * q_stride + j * group * D, q_stride, out + (start * nh + j * group) * D,
                               nh * D, group, j, kv_lens[task.seq] - n, task.i0, task.i1, window, scale};
        const PagedKV<T> kv{k_cache, v_cache, block_tables + task.seq * width, bs, nkv, D};
        prefill_tile(t, kv, w);
      }
    }
  }
  return 0;
}

}  // namespace pagemill
