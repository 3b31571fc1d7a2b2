// int8_rows.h's linear on AMX tiles (tdpbusd: unsigned activations x signed
// weights, exact int32 sums), where the CPU has AMX-INT8; used by
// int8_rows.h, which falls back to its vpdpbusd tiles elsewhere.
//
// The packed weight [N/16][Kp/4][16][4] is the B-tile form (amx.h): a tile
// is 64 k of one block. The sums are the same integers as vpdpbusd's (both
// exact), and they go through int8_rows.h's epilogue, so the outputs are the
// VNNI path's bit for bit.
#pragma once
#include <stdint.h>

#include "common/amx.h"
#include "int8/int8_tile.h"  // Args, store_sums

#if defined(PAGEMILL_AMX_TILE) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEMILL_AMX_INT8 1
#endif

namespace pagemill::int8 {

#if defined(PAGEMILL_AMX_INT8)
constexpr bool kAmxBuilt = true;

// tdpbusd: unsigned activations x signed weights, 4 bytes per lane into exact int32 sums.
struct DpInt8 {
  template <int C>  // the sums tile; its row and weight tiles as amx::multiply pairs them
  static void dp() {
    if constexpr (C == 4) _tile_dpbusd(4, 0, 2);
    else if constexpr (C == 5) _tile_dpbusd(5, 0, 3);
    else if constexpr (C == 6) _tile_dpbusd(6, 1, 2);
    else _tile_dpbusd(7, 1, 3);  // (the intrinsics take literal tile numbers)
  }
};

// Rows [m0, m0 + rows0 + rows1) x blocks [b0, b0 + NB): Kp / 64 steps of up to 4 tile multiplies.
template <bool TWO_ROWS, int NB>
void amx_tile(const Args& a, int64_t m0, int rows0, int rows1, int64_t b0, int32_t* sums, amx::Ahead ahead) {
  const int64_t block_bytes = a.Kp * kBlock;
  amx::multiply<DpInt8, TWO_ROWS, NB>((const char*)a.wq + b0 * block_bytes, block_bytes,
                                      (const char*)(a.xu + m0 * a.Kp), a.Kp, a.Kp / 64, ahead);
  amx::store<TWO_ROWS, NB>(sums);
  store_sums(a, m0, rows0 + rows1, b0, NB, sums, 32);
}

// Whether share() takes the tiles for `a`: whole 64-k steps and 8+ rows. Measured against the
// vpdpbusd tiles (benchmarks/int8_amx.py, default model's linears, 2 threads, bf16 rows in):
// 5 rows 0.74-1.05x, 8 0.93-1.27x, 16 1.23-1.75x, 64 1.5-2.1x, 2048 1.7-2.8x.
constexpr int64_t kAmxMinRows = 8;
inline bool amx_takes(const Args& a) { return a.Kp % 64 == 0 && a.M >= kAmxMinRows && amx::permitted(); }

// Rows walked per pass over a thread's blocks: 256 rows of Kp = 1536 are 384 KB, inside L2.
constexpr int64_t kAmxChunkRows = 256;

inline void share_amx(const Args& a, int t, int nt) {
  const int64_t blocks = (a.N + kBlock - 1) / kBlock;
  alignas(64) int32_t sums[32 * 32];
  amx::walk(a.wq, balance::bound(a.balance, blocks, t, nt), balance::bound(a.balance, blocks, t + 1, nt), a.M,
            kAmxChunkRows, a.Kp * kBlock,
            [&](int64_t m, int r0, int r1, int64_t b, bool two, amx::Ahead ahead) {
              if (r1 && two) amx_tile<true, 2>(a, m, r0, r1, b, sums, ahead);
              else if (r1) amx_tile<true, 1>(a, m, r0, r1, b, sums, ahead);
              else if (two) amx_tile<false, 2>(a, m, r0, 0, b, sums, ahead);
              else amx_tile<false, 1>(a, m, r0, 0, b, sums, ahead);
            });
}
#else
constexpr bool kAmxBuilt = false;
inline bool amx_takes(const Args&) { return false; }
inline void share_amx(const Args&, int, int) {}
#endif

}  // namespace pagemill::int8
