// gemm_bf16.h's tiles: the call's arguments (Args), the epilogue that stores a tile's float32
// sums (store_sums: bias, bf16 rounding, SwiGLU) and the vdpbf16ps register tiles; shared with
// gemm_amx.h, whose AMX tiles end in the same epilogue.
#pragma once
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common/bf16_row_ops.h"  // silu16, round16: the SwiGLU epilogue
#include "common/team_balance.h"
#include "common/vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagemill::gemm {

#if defined(__AVX512BF16__)
constexpr bool kDpbf16 = true;
#else
constexpr bool kDpbf16 = false;
#endif

constexpr int kBlock = 16;  // output channels per packed block
constexpr int kTileRows = 6;
constexpr int kTileBlocks = 4;
// Rows walked per pass over a thread's blocks: 256 rows of K = 1536 are 768 KB,
// inside a 1 MB L2 beside the 4 weight blocks of a tile.
constexpr int64_t kChunkRows = 256;

struct Args {
  const bf16* x;  // [M, K] rows `ldx` elements apart, K even
  int64_t ldx;
  const bf16* w;  // packed [Np/16][K/2][16][2]
  const bf16* bias;  // [N] or null
  bf16* y;  // [M, N] rows `ldy` elements apart ([M, N/2] with swiglu)
  int64_t ldy;
  int64_t M, N, K;
  bool swiglu = false;  // w (and bias) interleaved gate/up blocks, y = silu(gate) * up; N % 32 == 0
  balance::TeamBalance* balance = nullptr;  // the threads' shares of the blocks (null: even)
};

// Weight lines of the next group of blocks a tile asks for into L2 while it
// computes, spread over its loop (see share()).
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0;
};

#if defined(__AVX512BF16__)
// The float32 sums of rows [m0, m0+mr) x blocks [b0, b0+nb) (row m, block j at
// sums[m * ld + j * 16]) plus bias, rounded to bf16 and written to y; under
// swiglu (nb even) each (gate, up) block pair becomes silu(gate) * up.
inline void store_sums(const Args& a, int64_t m0, int mr, int64_t b0, int nb, const float* sums, int64_t ld) {
  if (a.swiglu && nb % 2 == 0) {  // blocks j (gate) and j + 1 (up) of the same 16 outputs
    for (int j = 0; j < nb; j += 2) {
      const int64_t n = (b0 + j) * kBlock;  // the gate block's first row of the interleaved weight
      const __m512 gb = a.bias ? load16(a.bias + n) : _mm512_setzero_ps();
      const __m512 ub = a.bias ? load16(a.bias + n + kBlock) : _mm512_setzero_ps();
      for (int m = 0; m < mr; ++m) {
        const __m512 g = rows::round16(_mm512_add_ps(_mm512_load_ps(sums + m * ld + j * kBlock), gb));
        const __m512 u = rows::round16(_mm512_add_ps(_mm512_load_ps(sums + m * ld + (j + 1) * kBlock), ub));
        const __m512 act = _mm512_mul_ps(rows::round16(rows::silu16(g)), u);
        _mm256_storeu_si256((__m256i*)(a.y + (m0 + m) * a.ldy + n / 2), narrow_bf16(act));
      }
    }
    return;
  }
  // Two blocks at a time, each row's 32 outputs in one store: a wide output's rows (the LM
  // head's [rows, 49152]: 96 KB apart) share their L1 and L2 sets, and a line written half by
  // half was evicted in between and fetched twice (measured: the head at 64 rows took 1.3x).
  for (int j = 0; j < nb; j += 2) {
    const int64_t n = (b0 + j) * kBlock;
    const int64_t valid = a.N - n < 2 * kBlock ? a.N - n : 2 * kBlock;
    const __mmask32 mask = valid >= 2 * kBlock ? (__mmask32)0xffffffffu : (__mmask32)((1u << valid) - 1);
    const int64_t valid1 = valid - kBlock < 0 ? 0 : valid - kBlock;  // of the second block (j + 1 < nb or 0)
    const __m512 bias0 = a.bias ? load16(a.bias + n, valid < kBlock ? valid : kBlock) : _mm512_setzero_ps();
    const __m512 bias1 = a.bias && valid1 > 0 ? load16(a.bias + n + kBlock, valid1) : _mm512_setzero_ps();
    for (int m = 0; m < mr; ++m) {
      const __m256i lo = narrow_bf16(_mm512_add_ps(_mm512_load_ps(sums + m * ld + j * kBlock), bias0));
      const __m256i hi = j + 1 < nb ? narrow_bf16(_mm512_add_ps(_mm512_load_ps(sums + m * ld + (j + 1) * kBlock), bias1))
                                    : _mm256_setzero_si256();
      _mm512_mask_storeu_epi16(a.y + (m0 + m) * a.ldy + n, j + 1 < nb ? mask : (mask & 0xffffu),
                               _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    }
  }
}

// Rows [m0, m0+MR) x blocks [b0, b0+NB). As in int8_rows.h, GCC keeps the
// accumulators in registers only when the constant loops are unrolled early.
template <int MR, int NB>
void tile(const Args& a, int64_t m0, int64_t b0, Ahead ahead) {
  __m512 acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t pairs = a.K / 2, block_elems = a.K * kBlock;
  const bf16* w = a.w + b0 * block_elems;
  const bf16* x = a.x + m0 * a.ldx;
  const int64_t per = (ahead.lines + pairs - 1) / pairs;  // lines asked for per pair
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t q = p * per; q < (p + 1) * per && q < ahead.lines; ++q) _mm_prefetch(ahead.p + 64 * q, _MM_HINT_T1);
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * block_elems + p * 32);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      int32_t two;
      memcpy(&two, x + m * a.ldx + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(two);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
    }
  }
  alignas(64) float sums[MR][NB][kBlock];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) _mm512_store_ps(sums[m][j], acc[m][j]);
  store_sums(a, m0, MR, b0, NB, &sums[0][0][0], NB * kBlock);
}

template <int MR>
void tile_blocks(const Args& a, int64_t m0, int64_t b0, int nb, Ahead ahead) {
  switch (nb) {
    case 4: tile<MR, 4>(a, m0, b0, ahead); break;
    case 3: tile<MR, 3>(a, m0, b0, ahead); break;
    case 2: tile<MR, 2>(a, m0, b0, ahead); break;
    default: tile<MR, 1>(a, m0, b0, ahead); break;
  }
}

inline void tile_any(const Args& a, int64_t m0, int mr, int64_t b0, int nb, Ahead ahead) {
  switch (mr) {
    case 6: tile_blocks<6>(a, m0, b0, nb, ahead); break;
    case 5: tile_blocks<5>(a, m0, b0, nb, ahead); break;
    case 4: tile_blocks<4>(a, m0, b0, nb, ahead); break;
    case 3: tile_blocks<3>(a, m0, b0, nb, ahead); break;
    case 2: tile_blocks<2>(a, m0, b0, nb, ahead); break;
    default: tile_blocks<1>(a, m0, b0, nb, ahead); break;
  }
}
#else
// Portable: the same pairs summed in float32, one row and one block at a time.
inline void tile_any(const Args& a, int64_t m0, int mr, int64_t b0, int nb, Ahead) {
  const int64_t pairs = a.K / 2, block_elems = a.K * kBlock;
  for (int64_t b = b0; b < b0 + nb; ++b) {
    const bf16* w = a.w + b * block_elems;
    for (int64_t m = m0; m < m0 + mr; ++m) {
      const bf16* x = a.x + m * a.ldx;
      float acc[kBlock] = {0.f};
      for (int64_t p = 0; p < pairs; ++p) {
        const float x0 = to_float(x[2 * p]), x1 = to_float(x[2 * p + 1]);
        for (int j = 0; j < kBlock; ++j)
          acc[j] += to_float(w[p * 32 + 2 * j]) * x0 + to_float(w[p * 32 + 2 * j + 1]) * x1;
      }
      for (int j = 0; j < kBlock; ++j) {
        const int64_t n = b * kBlock + j;
        if (n < a.N) a.y[m * a.ldy + n] = from_float<bf16>(acc[j] + (a.bias ? to_float(a.bias[n]) : 0.f));
      }
    }
  }
}
#endif

}  // namespace pagemill::gemm
