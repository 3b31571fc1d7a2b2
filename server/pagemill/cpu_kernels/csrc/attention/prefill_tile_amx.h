// prefill_attention.h's tile on AMX tiles (prefill_attention_amx.h's products), with
// the online softmax updated once a block of 64 keys rather than once a chunk of 16.
//
// Why: with both products on tiles, what is left per (row group, chunk of 16 keys)
// is bookkeeping: the output rows' rescale (a load, FMA and store per 16 dims per
// row), the sums tiles' stores, the running max and sum. Measured, those, not the
// multiplies, set the kernel's speed. Over a block of four chunks the sums tiles add
// up all four chunks' products and the output is rescaled once.
//
// Same arithmetic otherwise: probabilities rounded to bf16 against the block's max,
// float32 sums. A row group takes only the block's chunks some of its rows see.
#pragma once

#include <stdint.h>
#include <string.h>
#include <algorithm>
#include <utility>

#include "attention/prefill_attention_amx.h"
#include "attention/prefill_tile.h"

#if defined(PAGEMILL_AMX_ATTENTION)
namespace pagemill {

constexpr int64_t kAmxBlockChunks = 4;  // chunks of 16 keys per softmax update

namespace amx_block {

// One block's keys and values where the tiles read them: its key rows copied into w.kb (zero
// rows past its keys), its values packed into w.vf for whole pairs of chunks, and the next
// block's first rows asked for (the blocks are scattered over the pool: no hardware prefetcher
// finds them).
template <int NV>
void stage(const PagedKV<bf16>& kv, PrefillScratch& w, int64_t lo, int64_t hi, int64_t b0, int64_t nb,
           int64_t chunks) {
  constexpr int D = 16 * NV;
  constexpr int64_t K = kKeyChunk * kAmxBlockChunks;
  alignas(64) static const float zero[256] = {};
  const bf16* zrow = (const bf16*)zero;
  const int64_t* offs = w.offs.data() + (b0 - lo);
  for (int64_t j = K; j < K + kKeyChunk && b0 + j < hi; ++j) {
    prefetch_row(kv.k + offs[j], D);
    prefetch_row(kv.v + offs[j], D);
  }
  bf16* kb = (bf16*)w.kb.data();
  for (int64_t j = 0; j < kKeyChunk * chunks; ++j) memcpy(kb + j * D, j < nb ? kv.k + offs[j] : zrow, D * 2);
  // Values for whole pairs of chunks (a chunk past the block's keys packs zero rows).
  for (int64_t q = 0; q < (chunks + 1) / 2 * 2; ++q) {
    const bf16* vrows[16];
    for (int64_t j = 0; j < 16; ++j) vrows[j] = 16 * q + j < nb ? kv.v + offs[16 * q + j] : zrow;
    pack_values<bf16, true, NV>(vrows, 16, w.vf.data() + 8 * D * q);  // (the tiles read all 8 pairs)
  }
}

// The chunks qa..qb-1 of the block that some row of row group rg sees (qa == qb: none).
inline std::pair<int64_t, int64_t> visible_chunks(const PrefillScratch& w, int64_t rg, int64_t rows, int64_t b0,
                                                  int64_t nb, int64_t chunks) {
  const int64_t rmin = w.rlo[16 * rg], rmax = w.rhi[std::min(16 * rg + 15, rows - 1)];
  int64_t qa = 0, qb = chunks;
  while (qa < qb && b0 + std::min(16 * (qa + 1), nb) <= rmin) ++qa;
  while (qb > qa && b0 + 16 * (qb - 1) >= rmax) --qb;
  return {qa, qb};
}

// Online softmax of row group rg over the block's chunks qa..qb-1, the 16 rows in the lanes: row
// r sees key b0 + j when rlo[r] <= b0 + j < rhi[r]. The scores s[16 j + r] are scaled in place,
// the running max moves once for the whole block, the probabilities go to sp as one bf16 pair
// of keys per row (inter: the lane order of that pairing), and the group's m, l and corr
// (e^(m_old - m_new), what the output rows are rescaled by) are updated.
inline void softmax(PrefillScratch& w, int64_t rg, int64_t b0, int64_t nb, int64_t qa, int64_t qb, float* s,
                    uint32_t* sp, __m512 scale, __m512i inter) {
  constexpr int64_t K = kKeyChunk * kAmxBlockChunks;
  const __m512i rlo = _mm512_loadu_si512((const void*)(w.rlo.data() + 16 * rg));
  const __m512i rhi = _mm512_loadu_si512((const void*)(w.rhi.data() + 16 * rg));
  __mmask16 vis[K];
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 16 * qa; j < 16 * qb; ++j) {
    const __m512i pos = _mm512_set1_epi32((int)(b0 + j));
    vis[j] = j < nb ? (__mmask16)(_mm512_cmple_epi32_mask(rlo, pos) & _mm512_cmplt_epi32_mask(pos, rhi)) : 0;
    const __m512 x = _mm512_mul_ps(_mm512_load_ps(s + 16 * j), scale);
    _mm512_store_ps(s + 16 * j, x);
    mx = _mm512_mask_max_ps(mx, vis[j], mx, x);
  }
  const __m512 m_old = _mm512_loadu_ps(w.m.data() + 16 * rg);
  const __m512 m_new = _mm512_max_ps(m_old, mx);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t kp = 8 * qa; kp < 8 * qb; ++kp) {  // (a row with no key yet has m_new -inf: masked out here)
    const __m512 a = _mm512_maskz_mov_ps(vis[2 * kp], exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(s + 32 * kp), m_new)));
    const __m512 b =
        _mm512_maskz_mov_ps(vis[2 * kp + 1], exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(s + 32 * kp + 16), m_new)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
    _mm512_store_si512((void*)(sp + 16 * kp), _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(b, a)));
  }
  // e^(m_old - m_new): 0 when m_old is -inf (-inf - -inf is NaN, clamped to e^-87: it scales 0s)
  const __m512 corr = exp_nonpositive(_mm512_sub_ps(m_old, m_new));
  _mm512_storeu_ps(w.corr.data() + 16 * rg, corr);
  _mm512_storeu_ps(w.l.data() + 16 * rg, _mm512_fmadd_ps(_mm512_loadu_ps(w.l.data() + 16 * rg), corr, sum));
  _mm512_storeu_ps(w.m.data() + 16 * rg, m_new);
}

// P.V of row group rg for the block: the probabilities of each pair of chunks pa0..pb-1 as one
// A tile [row][16 pairs of keys] (a skipped chunk's half zero), against the packed value pairs,
// added to the group's rescaled output rows (padding rows take no value pass).
template <int NV>
void values(PrefillScratch& w, int64_t rg, int64_t rows, int64_t qa, int64_t qb, const uint32_t* sp) {
  constexpr int D = 16 * NV;
  const int64_t pa0 = qa / 2, pb = (qb + 1) / 2;
  alignas(64) uint32_t pa[kAmxBlockChunks / 2][256];
  for (int64_t q = 2 * pa0; q < 2 * pb; ++q) {
    uint32_t* dst = pa[q / 2] + 8 * (q % 2);
    if (q >= qa && q < qb) {
      prefill_amx::transpose_8x16<16>(sp + 128 * q, dst);
    } else {
      for (int r = 0; r < 16; ++r) _mm256_store_si256((__m256i*)(dst + 16 * r), _mm256_setzero_si256());
    }
  }
  const int64_t rn = std::min<int64_t>(16, rows - 16 * rg);
  prefill_amx::block_values<NV>(pa + pa0, w.vf.data() + 16 * D * pa0, pb - pa0, w.corr.data() + 16 * rg, rn,
                                w.o.data() + 16 * rg * D);
}

}  // namespace amx_block

// A tile of query rows over its keys, a block of kAmxBlockChunks chunks at a time: the block
// staged once for all row groups, then per row group the scores of the chunks it sees (tiles),
// one softmax update, and P.V (tiles).
template <int NV>
void prefill_tile_amx(const PrefillTile<bf16>& t, const PagedKV<bf16>& kv, PrefillScratch& w) {
  static_assert(NV % 4 == 0, "the tiles take 64 dims a values pass");
  constexpr int D = 16 * NV;
  constexpr int64_t K = kKeyChunk * kAmxBlockChunks;
  const auto [rows, groups, lo, hi] = begin_tile<bf16, NV, true>(t, kv, w);
  w.kb.resize(K * D / 2);                // the block's key rows, bf16, contiguous
  w.vf.resize(kAmxBlockChunks * 8 * D);  // per chunk: pack_values' [8 pairs][NV] vectors
  w.s.resize(K * 16 + K * 8);            // scores [K][16 rows], then probabilities' pairs [K / 2][16]
  float* s = w.s.data();
  uint32_t* sp = (uint32_t*)(s + K * 16);
  const __m512 scale = _mm512_set1_ps(t.scale);
  // Probabilities of keys 2kp, 2kp + 1 as one bf16 pair per row (rounded as torch's bf16 attention does).
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  prefill_amx::configure();
  for (int64_t b0 = lo; b0 < hi; b0 += K) {
    const int64_t nb = std::min(K, hi - b0), chunks = (nb + kKeyChunk - 1) / kKeyChunk;
    amx_block::stage<NV>(kv, w, lo, hi, b0, nb, chunks);
    const bf16* kb = (const bf16*)w.kb.data();
    for (int64_t rg = 0; rg < groups; ++rg) {
      const auto [qa, qb] = amx_block::visible_chunks(w, rg, rows, b0, nb, chunks);
      if (qa == qb) continue;
      for (int64_t q = qa; q < qb; ++q)
        prefill_amx::scores<D>(w.q.data() + rg * 16 * D, kb + 16 * D * q, s + 256 * q);
      amx_block::softmax(w, rg, b0, nb, qa, qb, s, sp, scale, inter);
      amx_block::values<NV>(w, rg, rows, qa, qb, sp);
    }
  }
  prefill_amx::release();
  end_tile<bf16, NV>(t, w, rows);
}

}  // namespace pagemill
#endif
