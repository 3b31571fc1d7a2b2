// prefill_attention.h's two products on AMX tiles (tdpbf16ps), for bf16
// pools with head_dim a multiple of 32, where the CPU has AMX-BF16: the
// tile's walk, online softmax and roundings stay prefill_tile_avx512's.
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
// - out [16 rows][16 dims] per 16 dims = probabilities [16 rows][16 keys]
//   (A tile: the bf16 pairs of keys per row, the one transpose, 128 words) .
//   values (B tiles: pack_values' pairs of value rows), added to the output
//   rows after their rescale, in float32 as before.
#pragma once
#include <stdint.h>

#include <type_traits>

#include "amx.h"
#include "vec.h"

#if defined(PAGEMILL_AMX_TILE) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEMILL_AMX_ATTENTION 1
#endif

namespace pagemill::prefill_amx {

#if defined(PAGEMILL_AMX_ATTENTION)
// Tiles: 0 keys (A), 1 queries (B), 2 scores (C), 3 probabilities (A: 16 keys, 32 bytes a
// row), 4 values (B: 8 pairs of keys), 5 outputs (C).
inline void configure() {
  amx::TileConfig c;
  const uint8_t rows[6] = {16, 16, 16, 16, 8, 16};
  const uint16_t colsb[6] = {64, 64, 64, 32, 64, 64};
  for (int i = 0; i < 6; ++i) {
    c.rows[i] = rows[i];
    c.colsb[i] = colsb[i];
  }
  _tile_loadconfig(&c);
}

inline void release() { _tile_release(); }

// Whether a pool of T with head size D takes the tiles in this process.
template <typename T>
inline bool takes(int64_t D) {
  return std::is_same_v<T, bf16> && D % 32 == 0 && amx::permitted();
}

// acc[j] lane r = q[r] . k[j]: kb the chunk's 16 key rows (bf16, D apart, zero past its
// keys), qt the row group's query pairs [D/2][16 lanes] (bf16 pairs).
template <int D>
inline void scores(const void* qt, const void* kb, __m512* acc) {
  alignas(64) float s[16 * 16];
  _tile_zero(2);
  for (int st = 0; st < D / 32; ++st) {
    _tile_loadd(0, (const char*)kb + 64 * st, D * 2);
    _tile_loadd(1, (const char*)qt + 1024 * st, 64);
    _tile_dpbf16ps(2, 0, 1);
  }
  _tile_stored(2, s, 64);
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_load_ps(s + 16 * j);
}

// o[r] = o[r] * corr[r] + sum_j p[r][j] v[j] for the first `rows` rows of a row group:
// pp the probabilities as bf16 pairs of keys [8][16 lanes], vp pack_values' pairs of value
// rows [8][NV] vectors.
template <int NV>
inline void values(const void* pp, const void* vp, const float* corr, int64_t rows, float* o) {
  constexpr int D = 16 * NV;
  alignas(64) uint32_t pa[16 * 8];  // [row][pair of keys]
  const uint32_t* p = (const uint32_t*)pp;
  for (int kp = 0; kp < 8; ++kp)
    for (int r = 0; r < 16; ++r) pa[r * 8 + kp] = p[16 * kp + r];
  _tile_loadd(3, pa, 32);
  alignas(64) float t[16 * 16];
  for (int c = 0; c < NV; ++c) {
    _tile_zero(5);
    _tile_loadd(4, (const char*)vp + 64 * c, NV * 64);
    _tile_dpbf16ps(5, 3, 4);
    _tile_stored(5, t, 64);
    for (int64_t r = 0; r < rows; ++r) {
      float* orow = o + r * D + 16 * c;
      _mm512_storeu_ps(orow, _mm512_fmadd_ps(_mm512_loadu_ps(orow), _mm512_set1_ps(corr[r]), _mm512_load_ps(t + 16 * r)));
    }
  }
}
#else
template <typename T>
inline bool takes(int64_t) {
  return false;
}
#endif

}  // namespace pagemill::prefill_amx
