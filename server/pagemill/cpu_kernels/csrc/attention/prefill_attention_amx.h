// prefill_attention.h's two products on AMX tiles (tdpbf16ps), for bf16
// pools of head size 64, 128 or 256, where the CPU has AMX-BF16; the tile's
// walk and its online softmax are prefill_tile_amx.h's, the roundings those of
// prefill_tile_avx512.
//
// Why: with vdpbf16ps both products of a chunk of 16 keys x a row group of
// 16 query rows take ~D/2 x 16 dot instructions each, and on this kind of
// CPU those issue at ~115 GFLOP/s a core: measured, prefill attention was
// ~17% of a 2048-token prefill step. A tile multiply does 16 x 16 x 32 in
// one instruction.
//
// Both products are taken with the query rows in the lanes, as the softmax
// holds them, so nothing the avx512 path builds is transposed:
// - scores^T [16 keys][16 rows] = keys [16][D] (A tiles: the chunk's rows as
//   copied for vdpbf16ps) . queries^T (B tiles: the row group's bf16 pairs
//   [D/2][16], as packed for vdpbf16ps);
// - out [16 rows][16 dims] per 16 dims = probabilities [16 rows][32 keys]
//   (A tile: the bf16 pairs of keys per row of two chunks, the one transpose)
//   . values (B tiles: pack_values' pairs of value rows of the two chunks),
//   summed over a block of chunks, then added to the output rows after their
//   rescale, in float32 as before.
#pragma once
#include <stdint.h>

#include "common/amx.h"
#include "common/vec.h"

#if defined(PAGEMILL_AMX_TILE) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEMILL_AMX_ATTENTION 1
#endif

namespace pagemill::prefill_amx {

#if defined(PAGEMILL_AMX_ATTENTION)
// Tiles, all 16 rows of 64 bytes: scores: 0 keys (A), 1 queries (B), 2 sums (C); values:
// 3 probabilities (A: 32 keys), 4 and 6 values (B: 16 pairs of keys), 5, 7, 0 and 2 sums (C).
inline void configure() {
  amx::TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

inline void release() { _tile_release(); }

// s[16 j + r] = q[r] . k[j]: kb the chunk's 16 key rows (bf16, D apart, zero past its
// keys), qt the row group's query pairs [D/2][16 lanes] (bf16 pairs).
template <int D>
inline void scores(const void* qt, const void* kb, float* s) {
  _tile_zero(2);
  for (int st = 0; st < D / 32; ++st) {
    _tile_loadd(0, (const char*)kb + 64 * st, D * 2);
    _tile_loadd(1, (const char*)qt + 1024 * st, 64);
    _tile_dpbf16ps(2, 0, 1);
  }
  _tile_stored(2, s, 64);
}

// pa[r * kStride + kp] = p[kp][r], 32-bit words: the probabilities' pairs of keys from the
// softmax's lanes (a row of query rows per pair) to the A tile's rows (a row of pairs per
// query row; kStride words apart, so two chunks' pairs can share a row).
template <int kStride>
inline void transpose_8x16(const uint32_t* p, uint32_t* pa) {
  __m512i x[8], a[8], e[8];
  for (int i = 0; i < 8; ++i) x[i] = _mm512_loadu_si512((const void*)(p + 16 * i));
  for (int i = 0; i < 4; ++i) {  // a[2i], a[2i+1]: pairs kp 2i, 2i+1 interleaved, rows 4L+0,1 and 4L+2,3
    a[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // e[4h + j]: row 4L + j's pairs 4h..4h+3 in 128-bit lane L
    const __m512i* q = a + 4 * h;
    e[4 * h] = _mm512_unpacklo_epi64(q[0], q[2]);
    e[4 * h + 1] = _mm512_unpackhi_epi64(q[0], q[2]);
    e[4 * h + 2] = _mm512_unpacklo_epi64(q[1], q[3]);
    e[4 * h + 3] = _mm512_unpackhi_epi64(q[1], q[3]);
  }
  const __m512i lanes01 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), lanes23 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int j = 0; j < 4; ++j) {
    const __m512i g = _mm512_permutex2var_epi64(e[j], lanes01, e[4 + j]);  // rows j, 4 + j
    const __m512i h = _mm512_permutex2var_epi64(e[j], lanes23, e[4 + j]);  // rows 8 + j, 12 + j
    _mm256_store_si256((__m256i*)(pa + kStride * j), _mm512_castsi512_si256(g));
    _mm256_store_si256((__m256i*)(pa + kStride * (4 + j)), _mm512_extracti64x4_epi64(g, 1));
    _mm256_store_si256((__m256i*)(pa + kStride * (8 + j)), _mm512_castsi512_si256(h));
    _mm256_store_si256((__m256i*)(pa + kStride * (12 + j)), _mm512_extracti64x4_epi64(h, 1));
  }
}

// o[r] = o[r] * corr[r] + sum_j p[r][j] v[j] over `pairs` pairs of chunks of 16 keys, for
// the first `rows` rows of a row group: pa[p] pair p's probabilities, a row of 16 pairs of
// keys per query row (transpose_8x16<16>'s, zero for a chunk the row group skips), vp their
// values as pack_values packs them (pairs of value rows [16][NV] vectors a pair of chunks:
// one tile multiply takes 32 keys). 64 dims at a time, in four sums tiles that add up the
// block, so that the output rows are rescaled once a block and no store waits for the
// multiply just issued (one tile at a time, the wait was ~15% of the kernel's samples).
template <int NV>
inline void block_values(const uint32_t (*pa)[256], const void* vp, int64_t pairs, const float* corr, int64_t rows,
                         float* o) {
  static_assert(NV % 4 == 0, "head sizes of 64, 128, 256");
  constexpr int D = 16 * NV;
  constexpr int64_t ld = NV * 64;
  alignas(64) float t[4][16 * 16];
  for (int c = 0; c < NV; c += 4) {
    _tile_zero(5);
    _tile_zero(7);
    _tile_zero(0);
    _tile_zero(2);
    for (int64_t p = 0; p < pairs; ++p) {
      const char* v = (const char*)vp + 16 * ld * p + 64 * c;
      _tile_loadd(3, pa[p], 64);
      _tile_loadd(4, v, ld);
      _tile_loadd(6, v + 64, ld);
      _tile_dpbf16ps(5, 3, 4);
      _tile_dpbf16ps(7, 3, 6);
      _tile_loadd(4, v + 128, ld);
      _tile_loadd(6, v + 192, ld);
      _tile_dpbf16ps(0, 3, 4);
      _tile_dpbf16ps(2, 3, 6);
    }
    _tile_stored(5, t[0], 64);
    _tile_stored(7, t[1], 64);
    _tile_stored(0, t[2], 64);
    _tile_stored(2, t[3], 64);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 cr = _mm512_set1_ps(corr[r]);
      for (int u = 0; u < 4; ++u) {
        float* orow = o + r * D + 16 * (c + u);
        _mm512_storeu_ps(orow, _mm512_fmadd_ps(_mm512_loadu_ps(orow), cr, _mm512_load_ps(t[u] + 16 * r)));
      }
    }
  }
}
#endif

}  // namespace pagemill::prefill_amx
