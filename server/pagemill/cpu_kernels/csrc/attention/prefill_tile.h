// prefill_attention.h's tile: a tile of a sequence's new tokens x the query heads of
// one kv head, its setup and end, and its walk over chunks of 16 keys (the portable
// loop and the AVX-512 one; prefill_attention.h says how and why).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "attention/paged_attention.h"
#include "common/vec.h"

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
  line_vector<float> q, o, s, kb, vf;  // (the AMX tiles load rows of q, kb and vf)
  std::vector<float> m, l, corr;
  std::vector<int64_t> offs;
  std::vector<int32_t> rlo, rhi;  // each row's keys: rlo..rhi-1
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

// Whether bf16 pairs meet in vdpbf16ps (T bf16 and the CPU has AVX512-BF16).
template <typename T>
#if defined(__AVX512BF16__)
constexpr bool kPrefillDp = std::is_same_v<T, bf16>;
#else
constexpr bool kPrefillDp = false;
#endif

// Scores of one row group (16 query rows in the lanes) against a chunk of 16
// keys (kb: their rows, contiguous): acc[j] lane r = q[r] . k[j]. vdpbf16ps on
// bf16 pairs (qt: [D/2][16] pairs, kb: bf16 rows) or FMA in float32 (qt: [D][16],
// kb: float rows). The key entries are broadcast from kb, the query columns loaded.
template <bool kDp, int D>
inline void chunk_scores(const void* qt, const void* kb, __m512* acc) {
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  if constexpr (kDp) {
#if defined(__AVX512BF16__)
    const uint32_t* q = (const uint32_t*)qt;
    const uint32_t* k = (const uint32_t*)kb;
    for (int c = 0; c < D / 2; ++c) {
      const __m512bh qc = (__m512bh)_mm512_loadu_si512((const void*)(q + 16 * c));
      for (int j = 0; j < 16; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], qc, (__m512bh)_mm512_set1_epi32((int)k[j * (D / 2) + c]));
    }
#endif
  } else {
    const float* q = (const float*)qt;
    const float* k = (const float*)kb;
    for (int d = 0; d < D; ++d) {
      const __m512 qd = _mm512_loadu_ps(q + 16 * d);
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(k[j * D + d]), acc[j]);
    }
  }
}

// o[r] = o[r] * corr[r] + sum_j p[r][j] v[j] for RB rows of a row group (their lanes
// r0..r0+RB-1 in p). kDp: p as bf16 pairs of keys pp[kp][16] and v as pairs of value
// rows vp[kp][NV] (lane e of vector c: dim 16c + e of keys 2kp, 2kp+1); else p float
// [j][16] and v float rows [j][D].
template <bool kDp, int NV, int RB>
inline void chunk_values(const void* p, const void* v, int64_t n, const float* corr, int64_t r0, float* o) {
  constexpr int D = 16 * NV;
  __m512 acc[RB][NV];
  for (int r = 0; r < RB; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r0 + r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), cr);
  }
  if constexpr (kDp) {
#if defined(__AVX512BF16__)
    const uint32_t* pp = (const uint32_t*)p + r0;
    const __m512i* vp = (const __m512i*)v;
    for (int64_t kp = 0; kp < (n + 1) / 2; ++kp) {
      __m512bh pk[RB];
      for (int r = 0; r < RB; ++r) pk[r] = (__m512bh)_mm512_set1_epi32((int)pp[16 * kp + r]);
      for (int c = 0; c < NV; ++c) {
        const __m512bh vc = (__m512bh)_mm512_loadu_si512((const void*)(vp + kp * NV + c));
        for (int r = 0; r < RB; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pk[r], vc);
      }
    }
#endif
  } else {
    const float* pf = (const float*)p + r0;
    const float* vf = (const float*)v;
    for (int64_t j = 0; j < n; ++j) {
      __m512 pj[RB];
      for (int r = 0; r < RB; ++r) pj[r] = _mm512_set1_ps(pf[16 * j + r]);
      for (int c = 0; c < NV; ++c) {
        const __m512 vc = _mm512_loadu_ps(vf + j * D + 16 * c);
        for (int r = 0; r < RB; ++r) acc[r][c] = _mm512_fmadd_ps(pj[r], vc, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

// The value pass's rows per register block: RB * NV accumulators <= 16 (+ RB broadcasts).
template <int NV>
constexpr int kValueRows = NV <= 4 ? 4 : (NV <= 8 ? 2 : 1);

// The chunk's value rows as chunk_values reads them (rows j >= n zero).
template <typename T, bool kDp, int NV>
inline void pack_values(const T* const* rows, int64_t n, void* dst) {
  constexpr int D = 16 * NV;
  if constexpr (kDp) {
    // Pairs of rows interleaved 16 bits at a time, then 128-bit lanes put back in dim order.
    __m512i* vp = (__m512i*)dst;  // (not 64-byte aligned: unaligned stores)
    const __m512i lo_idx = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    const __m512i hi_idx = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int64_t kp = 0; kp < (n + 1) / 2; ++kp) {
      const bf16 *a = rows[2 * kp], *b = rows[2 * kp + 1];
      for (int h = 0; h < D / 32; ++h) {
        const __m512i x = _mm512_loadu_si512((const void*)(a + 32 * h));
        const __m512i y = _mm512_loadu_si512((const void*)(b + 32 * h));
        const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
        _mm512_storeu_si512((void*)(vp + kp * NV + 2 * h), _mm512_permutex2var_epi64(lo, lo_idx, hi));
        _mm512_storeu_si512((void*)(vp + kp * NV + 2 * h + 1), _mm512_permutex2var_epi64(lo, hi_idx, hi));
      }
      if constexpr (NV % 2 == 1) {  // the last 16 dims of an odd NV
        const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a + D - 16)));
        const __m512i y = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b + D - 16)));
        const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
        _mm512_storeu_si512((void*)(vp + kp * NV + NV - 1), _mm512_permutex2var_epi64(lo, lo_idx, hi));
      }
    }
  } else {
    float* vf = (float*)dst;
    for (int64_t j = 0; j < n; ++j)
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(vf + j * D + 16 * c, load16(rows[j] + 16 * c));
  }
}

// What a tile's setup leaves to its key walk: query rows, row groups, keys lo..hi-1.
struct TileWalk {
  int64_t rows, groups, lo, hi;
};

// A tile's setup: queries transposed per row group, running max / sum / output
// zeroed, each row's key range, and the rows' offsets in the pool (w.offs, from lo).
template <typename T, int NV, bool kDp>
TileWalk begin_tile(const PrefillTile<T>& t, const PagedKV<T>& kv, PrefillScratch& w) {
  constexpr int D = 16 * NV;
  const int64_t rows = (t.i1 - t.i0) * t.group, groups = (rows + 15) / 16, R = 16 * groups;
  // Queries transposed per row group: [group][D/2 pairs or D dims][16 lanes].
  // The tile's query rows are read once, from wherever the projection left them: ask for
  // all of them at once (one row at a time, each miss was waited for: measured ~15% of a tile).
  for (int64_t i = t.i0; i < t.i1; ++i) prefetch_row(t.q + i * t.q_stride, t.group * D);
  w.q.assign(R * D, 0.f);
  w.o.assign(R * D, 0.f);
  w.m.assign(R, -INFINITY);
  w.l.assign(R, 0.f);
  w.corr.resize(R);
  w.rlo.assign(R, 0);
  w.rhi.assign(R, 0);  // padding rows see no key
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = t.i0 + r / t.group, g = r % t.group, lane = r % 16;
    const T* src = t.q + i * t.q_stride + g * D;
    float* qg = w.q.data() + (r / 16) * 16 * D;
    if constexpr (kDp) {
      uint32_t* qp = (uint32_t*)qg;
      for (int64_t c = 0; c < D / 2; ++c) memcpy(qp + 16 * c + lane, src + 2 * c, 4);
    } else {
      for (int64_t d = 0; d < D; ++d) qg[16 * d + lane] = to_float(src[d]);
    }
    w.rhi[r] = (int32_t)(t.cached + i + 1);
    w.rlo[r] = (int32_t)first_key(w.rhi[r], t.window);
  }
  const int64_t lo = first_key(t.cached + t.i0 + 1, t.window), hi = t.cached + t.i1;
  w.offs.resize(hi - lo);
  kv.rows(lo, hi, t.kv_head, w.offs.data());
  return {rows, groups, lo, hi};
}

// A tile's end: each row's output divided by its sum, stored in the pool's dtype.
template <typename T, int NV>
void end_tile(const PrefillTile<T>& t, const PrefillScratch& w, int64_t rows) {
  constexpr int D = 16 * NV;
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

template <typename T, int NV>
void prefill_tile_avx512(const PrefillTile<T>& t, const PagedKV<T>& kv, PrefillScratch& w) {
  constexpr int D = 16 * NV;
  constexpr bool kDp = kPrefillDp<T>;
  const auto [rows, groups, lo, hi] = begin_tile<T, NV, kDp>(t, kv, w);
  w.kb.resize(16 * D);  // the chunk's keys, contiguous (bf16 rows for kDp, else float32)
  w.vf.resize(16 * D + 16 * NV);
  w.s.resize(16 * 16);  // one row group's probabilities
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
    const T* vrows[16];
    for (int64_t j = 0; j < 16; ++j) vrows[j] = j < n ? kv.v + offs[j] : (const T*)zero;
    pack_values<T, kDp, NV>(vrows, n, w.vf.data());
    if constexpr (kDp) {
      bf16* kb = (bf16*)w.kb.data();
      for (int64_t j = 0; j < 16; ++j) memcpy(kb + j * D, j < n ? (const void*)(kv.k + offs[j]) : (const void*)zero, D * 2);
    } else {
      for (int64_t j = 0; j < 16; ++j)
        for (int c = 0; c < NV; ++c)
          _mm512_storeu_ps(w.kb.data() + j * D + 16 * c, j < n ? load16(kv.k + offs[j] + 16 * c) : _mm512_setzero_ps());
    }
    for (int64_t rg = 0; rg < groups; ++rg) {
      if (c0 >= w.rhi[std::min(16 * rg + 15, rows - 1)] || c0 + n <= w.rlo[16 * rg]) continue;  // sees none of it
      __m512 acc[16];
      chunk_scores<kDp, D>(w.q.data() + rg * 16 * D, w.kb.data(), acc);
      // Online softmax, the 16 rows in the lanes: row r sees key c0 + j when rlo[r] <= c0 + j < rhi[r].
      const __m512i rlo = _mm512_loadu_si512((const void*)(w.rlo.data() + 16 * rg));
      const __m512i rhi = _mm512_loadu_si512((const void*)(w.rhi.data() + 16 * rg));
      __mmask16 vis[16];
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int j = 0; j < 16; ++j) {
        const __m512i pos = _mm512_set1_epi32((int)(c0 + j));
        vis[j] = j < n ? (__mmask16)(_mm512_cmple_epi32_mask(rlo, pos) & _mm512_cmplt_epi32_mask(pos, rhi)) : 0;
        acc[j] = _mm512_mul_ps(acc[j], scale);
        mx = _mm512_mask_max_ps(mx, vis[j], mx, acc[j]);
      }
      const __m512 m_old = _mm512_loadu_ps(w.m.data() + 16 * rg);
      const __m512 m_new = _mm512_max_ps(m_old, mx);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < 16; ++j) {  // (a row with no key yet has m_new -inf: masked out here)
        acc[j] = _mm512_maskz_mov_ps(vis[j], exp_nonpositive(_mm512_sub_ps(acc[j], m_new)));
        sum = _mm512_add_ps(sum, acc[j]);
      }
      // e^(m_old - m_new): 0 when m_old is -inf (-inf - -inf is NaN, clamped to e^-87: it scales 0s)
      const __m512 corr = exp_nonpositive(_mm512_sub_ps(m_old, m_new));
      _mm512_storeu_ps(w.corr.data() + 16 * rg, corr);
      _mm512_storeu_ps(w.l.data() + 16 * rg, _mm512_fmadd_ps(_mm512_loadu_ps(w.l.data() + 16 * rg), corr, sum));
      _mm512_storeu_ps(w.m.data() + 16 * rg, m_new);
      if constexpr (kDp) {
#if defined(__AVX512BF16__)
        // Probabilities of keys 2kp, 2kp + 1 as one bf16 pair per row (rounded as torch's bf16 attention does).
        const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                               6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        for (int kp = 0; kp < 8; ++kp) {
          const __m512i x = (__m512i)_mm512_cvtne2ps_pbh(acc[2 * kp + 1], acc[2 * kp]);
          _mm512_storeu_si512((void*)(w.s.data() + 16 * kp), _mm512_permutexvar_epi16(inter, x));
        }
#endif
      } else {
        for (int j = 0; j < 16; ++j) _mm512_storeu_ps(w.s.data() + 16 * j, acc[j]);
      }
      constexpr int RB = kValueRows<NV>;
      const int64_t rmax = std::min<int64_t>(16, rows - 16 * rg);  // padding rows: no value pass
      for (int64_t r = 0; r < rmax; r += RB)
        chunk_values<kDp, NV, RB>(w.s.data(), w.vf.data(), n, w.corr.data() + 16 * rg, r,
                                  w.o.data() + (16 * rg + r) * D);
    }
  }
  end_tile<T, NV>(t, w, rows);
}
#endif

}  // namespace pagemill
