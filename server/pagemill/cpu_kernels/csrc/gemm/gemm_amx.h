// gemm_bf16.h's linear on AMX tiles (tdpbf16ps), where the CPU has AMX-BF16;
// used by gemm_bf16.h, which falls back to its vdpbf16ps tiles elsewhere.
//
// Why: one tile multiply does 16 x 16 outputs x 32 k, ~8x a core's vdpbf16ps
// rate, so prefill and large decode batches stop being bound by the
// multiplies. oneDNN has AMX kernels too, but taking them would give up the
// batched decode layer and the SwiGLU epilogue, which are written against
// this weight layout (amx.h: it is already the B-tile form).
//
// The sums go through gemm_bf16.h's epilogue (bias, bf16 rounding, SwiGLU),
// so the outputs round as the vdpbf16ps path's do; the float32 sums
// themselves are added in another order.
#pragma once
#include <stdint.h>

#include "common/amx.h"
#include "gemm/gemm_tile.h"  // Args, store_sums

#if defined(PAGEMILL_AMX_TILE) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEMILL_AMX_BF16 1
#endif

namespace pagemill::gemm {

#if defined(PAGEMILL_AMX_BF16)
constexpr bool kAmxBuilt = true;

// A tile's sums waiting for the epilogue: run while the next tile's multiplies drain (the tile
// unit works on while the core runs the vector epilogue), so the two overlap. Measured on a
// 2048-row prefill linear the epilogue after the multiplies was ~30% of the call.
struct Pending {
  int64_t m0 = 0, b0 = 0;
  int rows = 0, nb = 0;
  const float* sums = nullptr;

  void flush(const Args& a) {
    if (sums) store_sums(a, m0, rows, b0, nb, sums, 32);
    sums = nullptr;
  }
};

// tdpbf16ps: bf16 pairs into float32 sums.
struct DpBf16 {
  template <int C>  // the sums tile; its row and weight tiles as amx::multiply pairs them
  static void dp() {
    if constexpr (C == 4) _tile_dpbf16ps(4, 0, 2);
    else if constexpr (C == 5) _tile_dpbf16ps(5, 0, 3);
    else if constexpr (C == 6) _tile_dpbf16ps(6, 1, 2);
    else _tile_dpbf16ps(7, 1, 3);  // (the intrinsics take literal tile numbers)
  }
};

// Rows [m0, m0 + rows0 + rows1) x blocks [b0, b0 + NB): K / 32 steps of up to 4 tile multiplies,
// then the previous tile's epilogue (pending), then this one's sums into `sums` as the new
// pending. ahead: weight lines asked for into L2 along the way (amx::walk).
// The weight tiles load with the streaming hint: each weight row serves the rows of one walk
// step and is not read again from L1, while the activation rows are, pair after pair; loaded
// plainly, the weights pushed them out. Measured (2026-12-06, weights from a 600 MB ring in
// huge pages, 2 threads, docs/cpu.md): 24 rows 0.93-0.94x on qkv, o_proj and gate_up,
// 256-2044 rows (prefill) 0.79-0.90x on those and 0.97-1.0x on down (K 1536: its rows do not
// fit L1 either way).
template <bool TWO_ROWS, int NB>
void amx_tile(const Args& a, int64_t m0, int rows0, int rows1, int64_t b0, float* sums, amx::Ahead ahead,
              Pending& pending) {
  const int64_t block_bytes = a.K * kBlock * (int64_t)sizeof(bf16), ldx = a.ldx * (int64_t)sizeof(bf16);
  amx::multiply<DpBf16, TWO_ROWS, NB, true>((const char*)a.w + b0 * block_bytes, block_bytes,
                                      (const char*)(a.x + m0 * a.ldx), ldx, a.K / 32, ahead);
  pending.flush(a);
  amx::store<TWO_ROWS, NB>(sums);
  pending = Pending{m0, b0, rows0 + rows1, NB, sums};
}

// Whether share() takes the tiles for `a`: whole 32-k steps, and enough rows. Measured against
// the vdpbf16ps tiles (default model's linears, 2 threads, weights from L3): 4 rows 1.2-1.6x,
// 2 rows even.
constexpr int64_t kAmxMinRows = 4;
inline bool amx_takes(const Args& a) { return a.K % 32 == 0 && a.M >= kAmxMinRows && amx::permitted(); }

// share()'s walk on tiles: thread t of nt takes its range of blocks (a.balance's shares).
inline void share_amx(const Args& a, int t, int nt) {
  const int64_t blocks = (a.N + kBlock - 1) / kBlock, block_bytes = a.K * kBlock * (int64_t)sizeof(bf16);
  const int64_t unit = a.swiglu ? 2 : 1, units = blocks / unit;  // swiglu: whole (gate, up) pairs
  alignas(64) float sums[2][32 * 32];  // this tile's and the pending one's
  Pending pending;
  int flip = 0;
  amx::walk(a.w, balance::bound(a.balance, units, t, nt) * unit, balance::bound(a.balance, units, t + 1, nt) * unit,
            a.M, kChunkRows, block_bytes,
            [&](int64_t m, int r0, int r1, int64_t b, bool two, amx::Ahead ahead) {
              float* s = sums[flip ^= 1];
              if (r1 && two) amx_tile<true, 2>(a, m, r0, r1, b, s, ahead, pending);
              else if (r1) amx_tile<true, 1>(a, m, r0, r1, b, s, ahead, pending);
              else if (two) amx_tile<false, 2>(a, m, r0, 0, b, s, ahead, pending);
              else amx_tile<false, 1>(a, m, r0, 0, b, s, ahead, pending);
            });
  pending.flush(a);
}
#else
constexpr bool kAmxBuilt = false;
inline bool amx_takes(const Args&) { return false; }
inline void share_amx(const Args&, int, int) {}
#endif

}  // namespace pagemill::gemm
