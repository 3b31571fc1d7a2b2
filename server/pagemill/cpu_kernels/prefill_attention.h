// Paged attention of prompt chunks (prefill), float32 or bfloat16 pools: a
// TILE of a sequence's new tokens x the query heads of one kv head against the
// sequence's cache, streamed once per tile.
//
// Why: the decode kernel (paged_attention.h) took every new token as its own
// one-row query, so each key and value row of a 256-token prompt was read and
// widened ~128 times and every score was a dot product of one query. Here a
// tile of up to kPrefillRows query rows (tokens x group) meets each chunk of
// 16 keys once:
// - keys: the chunk is transposed once (16 keys in the lanes of a vector, one
//   vector per 32-bit column: a bf16 pair of dims, or one float32 dim), so a
//   query row's 16 scores are D/2 vdpbf16ps (bf16 with AVX512-BF16: the query
//   and keys as stored, float32 sums) or D FMAs (float32; bf16 without
//   AVX512-BF16 splits each pair into its two float32 halves), with the query
//   entry broadcast and no horizontal sums.
// - softmax: online (flash-style) in float32, per row a running max m and sum
//   l; the output is rescaled by e^(m_old - m_new) when the max grows.
// - values: the chunk widened once to float32, P.V FMA'd into float32
//   accumulators in registers for a few rows at a time.
// Causal inside the chunk (new token i at position cached + i sees keys
// 0..cached + i) and the sliding window (key > query - window) are per-row
// key ranges; a tile streams from its first row's first key to its last row.
// Without AVX-512 (or head_dim not a multiple of 16, or over 256) a scalar
// loop computes the same thing, one row at a time.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "paged_attention.h"
#include "vec.h"

namespace pagemill {

// Query rows (tokens x group) a tile holds: more rows read each key chunk for
// more queries; fewer give more tasks to share between threads.
constexpr int64_t kPrefillRows = 64;
constexpr int64_t kKeyChunk = 16;  // keys per chunk: the lanes of a vector

// A tile: new tokens i0..i1-1 of one sequence (token i at position cached + i)
// x the `group` query heads of kv head `kv_head`. q and out point at the
// sequence's first token's first head of the group; tokens q_stride / out_stride apart.
template <typename T>
struct PrefillTile {
  const T* q;
  int64_t q_stride;
  T* out;
  int64_t out_stride;
  int64_t group, kv_head, cached, i0, i1, window;
  float scale;
};

// Per-thread scratch, reused across tiles.
struct PrefillScratch {
  std::vector<float> q, o, s, vf, m, l, rowsum, mnew, corr;
  std::vector<int64_t> offs, rlo, rhi;
  std::vector<uint32_t> kt;
};

// The portable loop, one query row at a time (two passes over its keys).
template <typename T>
void prefill_tile_scalar(const PrefillTile<T>& t, const PagedKV<T>& kv, PrefillScratch& w) {
  const int64_t D = kv.head_dim;
  w.q.resize(2 * D);
  float *qf = w.q.data(), *o = qf + D;
  for (int64_t i = t.i0; i < t.i1; ++i) {
    const int64_t len = t.cached + i + 1, lo = first_key(len, t.window), n = len - lo;
    w.s.resize(n);
    float* s = w.s.data();
    for (int64_t g = 0; g < t.group; ++g) {
      const T* qr = t.q + i * t.q_stride + g * D;
      for (int64_t d = 0; d < D; ++d) qf[d] = to_float(qr[d]);
      float m = -INFINITY;
      for (int64_t k = 0; k < n; ++k) {
        s[k] = dot(qf, kv.k + kv.row(lo + k, t.kv_head), D) * t.scale;
        m = s[k] > m ? s[k] : m;
      }
      float sum = 0.f;
      for (int64_t k = 0; k < n; ++k) sum += (s[k] = expf(s[k] - m));
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t k = 0; k < n; ++k) axpy(s[k], kv.v + kv.row(lo + k, t.kv_head), o, D);
      T* out = t.out + i * t.out_stride + g * D;
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < D; ++d) out[d] = from_float<T>(o[d] * inv);
    }
  }
}

#if defined(__AVX512F__)

// Lane j of r[k] <- lane k of r[j]: a 16 x 16 transpose of 32-bit entries.
inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: pairs of rows interleaved
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4G + k], 128-bit lane L: column 4L + k of rows 4G..4G+3
  for (int G = 0; G < 4; ++G) {
    u[4 * G + 0] = _mm512_unpacklo_epi64(t[4 * G + 0], t[4 * G + 2]);
    u[4 * G + 1] = _mm512_unpackhi_epi64(t[4 * G + 0], t[4 * G + 2]);
    u[4 * G + 2] = _mm512_unpacklo_epi64(t[4 * G + 1], t[4 * G + 3]);
    u[4 * G + 3] = _mm512_unpackhi_epi64(t[4 * G + 1], t[4 * G + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // gather lane L of u[k], u[4+k], u[8+k], u[12+k] into column 4L + k
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// kt[c] lane j = 32-bit column c of key row j, for the `cols` columns of a row.
inline void pack_keys(const uint32_t* const* rows, int64_t cols, uint32_t* kt) {
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const __mmask16 m = first(cols - c0);
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_maskz_loadu_epi32(m, rows[j] + c0);
    transpose16x16(r);
    for (int64_t k = 0; k < 16 && c0 + k < cols; ++k) _mm512_storeu_si512((void*)(kt + 16 * (c0 + k)), r[k]);
  }
}

// s[r][j] = scale * q[r] . k[j] for RB rows: bf16 (qp: rows of D/2 bf16 pairs)
// or float32 (qf: rows of D floats) against the transposed chunk kt.
template <typename T, int RB, int D>
inline void chunk_scores(const float* qf, const uint32_t* qp, const uint32_t* kt, __m512 scale, float* s) {
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, bf16>) {
#if defined(__AVX512BF16__)
    (void)qf;
    for (int c = 0; c < D / 2; ++c) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512((const void*)(kt + 16 * c));
      for (int r = 0; r < RB; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)qp[r * (D / 2) + c]), k);
    }
#else
    (void)qp;
    for (int c = 0; c < D / 2; ++c) {  // the pair's low half is the even dim, its high half the odd one
      const __m512i k = _mm512_loadu_si512((const void*)(kt + 16 * c));
      const __m512 ke = _mm512_castsi512_ps(_mm512_slli_epi32(k, 16));
      const __m512 ko = _mm512_castsi512_ps(_mm512_and_si512(k, _mm512_set1_epi32((int)0xffff0000u)));
      for (int r = 0; r < RB; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r * D + 2 * c]), ke, acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r * D + 2 * c + 1]), ko, acc[r]);
      }
    }
#endif
  } else {
    (void)qp;
    for (int d = 0; d < D; ++d) {
      const __m512 k = _mm512_loadu_ps((const float*)(kt + 16 * d));
      for (int r = 0; r < RB; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r * D + d]), k, acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm512_storeu_ps(s + 16 * r, _mm512_mul_ps(acc[r], scale));
}

// o[r] = o[r] * corr[r] + sum_j p[r][j] v[j] for RB rows, v the chunk's n value rows in float32.
template <int NV, int RB>
inline void chunk_values(const float* p, const float* vf, int64_t n, const float* corr, float* o) {
  constexpr int D = 16 * NV;
  __m512 acc[RB][NV];
  for (int r = 0; r < RB; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), cr);
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 pj[RB];
    for (int r = 0; r < RB; ++r) pj[r] = _mm512_set1_ps(p[16 * r + j]);
    for (int c = 0; c < NV; ++c) {
      const __m512 v = _mm512_loadu_ps(vf + j * D + 16 * c);
      for (int r = 0; r < RB; ++r) acc[r][c] = _mm512_fmadd_ps(pj[r], v, acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

// The value pass's rows per register block: RB * NV accumulators <= 16 (+ RB broadcasts).
template <int NV>
constexpr int kValueRows = NV <= 4 ? 4 : (NV <= 8 ? 2 : 1);

// One chunk's online softmax for rows r < R: s (scores, row by row) becomes
// the probabilities against the new running max; corr the rescale of the old
// output and sum. Rows that see none of keys c0..c0+n-1 keep their state.
inline void chunk_softmax(PrefillScratch& w, int64_t R, int64_t c0, int64_t n) {
  float* s = w.s.data();
  for (int64_t r = 0; r < R; ++r, s += 16) {
    const int64_t a = std::max<int64_t>(w.rlo[r] - c0, 0), b = std::min<int64_t>(w.rhi[r] - c0, n);
    w.mnew[r] = w.m[r];
    if (b <= a) {
      _mm512_storeu_ps(s, _mm512_setzero_ps());
      w.rowsum[r] = 0.f;
      continue;
    }
    const __mmask16 vis = (__mmask16)(first(b) & ~first(a));
    const __m512 x = _mm512_maskz_loadu_ps(vis, s);
    const float mx = _mm512_mask_reduce_max_ps(vis, x);
    const float mn = mx > w.m[r] ? mx : w.m[r];
    const __m512 e = _mm512_maskz_mov_ps(vis, exp_nonpositive(_mm512_sub_ps(x, _mm512_set1_ps(mn))));
    _mm512_storeu_ps(s, e);
    w.mnew[r] = mn;
    w.rowsum[r] = _mm512_reduce_add_ps(e);
  }
  for (int64_t r = 0; r < R; r += 16) {  // e^(m_old - m_new), 16 rows at a time (m_old -inf: 0)
    const __mmask16 k = first(R - r);
    const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, w.m.data() + r), _mm512_maskz_loadu_ps(k, w.mnew.data() + r));
    const __m512 corr = exp_nonpositive(d);  // -inf - -inf (no key yet): NaN, clamped to e^-87 on 0s
    _mm512_mask_storeu_ps(w.corr.data() + r, k, corr);
    const __m512 l = _mm512_maskz_loadu_ps(k, w.l.data() + r);
    _mm512_mask_storeu_ps(w.l.data() + r, k, _mm512_fmadd_ps(l, corr, _mm512_maskz_loadu_ps(k, w.rowsum.data() + r)));
    _mm512_mask_storeu_ps(w.m.data() + r, k, _mm512_maskz_loadu_ps(k, w.mnew.data() + r));
  }
}

template <typename T, int NV>
void prefill_tile_avx512(const PrefillTile<T>& t, const PagedKV<T>& kv, PrefillScratch& w) {
  constexpr int D = 16 * NV;
  constexpr bool kPairs = std::is_same_v<T, bf16>;
  constexpr int64_t cols = kPairs ? D / 2 : D;  // 32-bit columns of a key row
#if defined(__AVX512BF16__)
  constexpr bool kDp = kPairs;
#else
  constexpr bool kDp = false;
#endif
  const int64_t rows = (t.i1 - t.i0) * t.group, R = (rows + 3) & ~(int64_t)3;  // padded: blocks of 4
  w.q.assign(R * D, 0.f);
  w.o.assign(R * D, 0.f);
  w.s.resize(R * 16);
  w.vf.resize(kKeyChunk * D);
  w.kt.resize(16 * cols);
  w.m.assign(R, -INFINITY);
  w.l.assign(R, 0.f);
  w.rowsum.resize(R);
  w.mnew.resize(R);
  w.corr.resize(R);
  w.rlo.assign(R, 0);
  w.rhi.assign(R, 0);  // padding rows see no key
  uint32_t* qp = (uint32_t*)w.q.data();  // bf16 pairs (the dp path) share the buffer
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = t.i0 + r / t.group, g = r % t.group;
    const T* src = t.q + i * t.q_stride + g * D;
    if constexpr (kDp)
      memcpy(qp + r * (D / 2), src, D * sizeof(T));
    else
      for (int64_t d = 0; d < D; ++d) w.q[r * D + d] = to_float(src[d]);
    w.rhi[r] = t.cached + i + 1;
    w.rlo[r] = first_key(w.rhi[r], t.window);
  }
  const int64_t lo = first_key(t.cached + t.i0 + 1, t.window), hi = t.cached + t.i1;
  w.offs.resize(hi - lo);
  kv.rows(lo, hi, t.kv_head, w.offs.data());
  alignas(64) static const float zero[256] = {};
  const __m512 scale = _mm512_set1_ps(t.scale);
  for (int64_t c0 = lo; c0 < hi; c0 += kKeyChunk) {
    const int64_t n = std::min<int64_t>(kKeyChunk, hi - c0);
    const int64_t* offs = w.offs.data() + (c0 - lo);
    // The blocks are scattered over the pool (no hardware prefetcher finds
    // them): ask for the next chunk's rows while this one computes.
    for (int64_t j = kKeyChunk; j < 2 * kKeyChunk && c0 + j < hi; ++j) {
      prefetch_row(kv.k + offs[j], D);
      prefetch_row(kv.v + offs[j], D);
    }
    const uint32_t* krows[16];
    for (int64_t j = 0; j < 16; ++j) krows[j] = (const uint32_t*)(j < n ? (const void*)(kv.k + offs[j]) : (const void*)zero);
    pack_keys(krows, cols, w.kt.data());
    for (int64_t j = 0; j < n; ++j)  // (rows past n stay unread: their probabilities are 0)
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(w.vf.data() + j * D + 16 * c, load16(kv.v + offs[j] + 16 * c));
    int64_t r = 0;
    for (; r + 8 <= R; r += 8)
      chunk_scores<T, 8, D>(w.q.data() + r * D, qp + r * (D / 2), w.kt.data(), scale, w.s.data() + 16 * r);
    for (; r < R; r += 4)
      chunk_scores<T, 4, D>(w.q.data() + r * D, qp + r * (D / 2), w.kt.data(), scale, w.s.data() + 16 * r);
    chunk_softmax(w, R, c0, n);
    constexpr int RB = kValueRows<NV>;
    for (r = 0; r < R; r += RB)
      chunk_values<NV, RB>(w.s.data() + 16 * r, w.vf.data(), n, w.corr.data() + r, w.o.data() + r * D);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = t.i0 + r / t.group, g = r % t.group;
    T* dst = t.out + i * t.out_stride + g * D;
    const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);
    for (int c = 0; c < NV; ++c) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * D + 16 * c), inv);
      if constexpr (std::is_same_v<T, bf16>)
        _mm256_storeu_si256((__m256i*)(dst + 16 * c), narrow_bf16(x));
      else
        _mm512_storeu_ps((float*)(dst + 16 * c), x);
    }
  }
}
#endif

template <typename T>
void prefill_tile(const PrefillTile<T>& t, const PagedKV<T>& kv, PrefillScratch& w) {
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
  const bool parallel = work * group * D >= kAttendParallelWork;
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
