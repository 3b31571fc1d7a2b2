// gemm_bf16.h's linear on AMX tiles, where the CPU has AMX-BF16 (included by
// gemm_bf16.h, which falls back to its vdpbf16ps tiles elsewhere).
//
// Why: a tile multiply (tdpbf16ps) does 16 x 16 outputs x 32 k in one
// instruction, ~8x a core's vdpbf16ps rate, so prefill and large decode
// batches stop being bound by the multiplies. oneDNN has AMX kernels too, but
// taking them would give up the batched decode layer and the SwiGLU epilogue,
// which are written against this weight layout.
//
// The packed weight needs no new layout: a block's [K/2][16][2] is exactly an
// AMX B tile's "VNNI" form, 16 pairs of k (one 64-byte row each) x 16 output
// channels, so a B tile is 16 consecutive 64-byte rows of a block. A tiles are
// 16 activation rows x 32 k read in place (stride ldx). Each step keeps
// 2 row tiles (32 rows) x 2 blocks (32 outputs) in the 4 accumulator tiles,
// so every weight row loaded serves 32 rows. The sums are written through
// gemm_bf16.h's epilogue (bias, bf16 rounding, SwiGLU), so the outputs round
// as the vdpbf16ps path's do; the sums themselves are summed in another order.
//
// Linux grants the tiles' register state to a process only on request
// (arch_prctl); where it refuses, the vdpbf16ps path runs.
#pragma once
#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEMILL_AMX 1
#endif

namespace pagemill::gemm {

#if defined(PAGEMILL_AMX)
constexpr bool kAmxBuilt = true;

// Whether this process may use the tiles (asked once; the grant is process-wide).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureTiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTiledata) == 0;
  }();
  return ok;
}

// Tiles 0-1: activation rows, 2-3: weight blocks, 4-7: sums (row tile i x block j at 4 + 2i + j).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Rows in the first and second row tile (16 and 0..16); the weight tiles are always 16 x 64 bytes.
inline void configure(int rows0, int rows1) {
  TileConfig c;
  const int rows[8] = {rows0, rows1 ? rows1 : 1, 16, 16, rows0, rows0, rows1 ? rows1 : 1, rows1 ? rows1 : 1};
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = (uint8_t)rows[i];
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

// Rows [m0, m0 + rows0 + rows1) x blocks [b0, b0 + NB): K / 32 steps of up to 4 tile multiplies.
// ahead: weight lines asked for into L2 along the way (the next pair's, see share_amx).
template <bool TWO_ROWS, int NB>
void amx_tile(const Args& a, int64_t m0, int rows0, int rows1, int64_t b0, float* sums, Ahead ahead) {
  const int64_t block_elems = a.K * kBlock, steps = a.K / 32, ldx_bytes = a.ldx * (int64_t)sizeof(bf16);
  const int64_t per = (ahead.lines + steps - 1) / steps;  // lines asked for per step
  const bf16* w = a.w + b0 * block_elems;
  const bf16* x0 = a.x + m0 * a.ldx;
  const bf16* x1 = x0 + 16 * a.ldx;
  _tile_zero(4);
  if constexpr (NB == 2) _tile_zero(5);
  if constexpr (TWO_ROWS) {
    _tile_zero(6);
    if constexpr (NB == 2) _tile_zero(7);
  }
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t q = s * per; q < (s + 1) * per && q < ahead.lines; ++q) _mm_prefetch(ahead.p + 64 * q, _MM_HINT_T1);
    _tile_loadd(2, w + s * 512, 64);
    if constexpr (NB == 2) _tile_loadd(3, w + block_elems + s * 512, 64);
    _tile_loadd(0, x0 + s * 32, ldx_bytes);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (NB == 2) _tile_dpbf16ps(5, 0, 3);
    if constexpr (TWO_ROWS) {
      _tile_loadd(1, x1 + s * 32, ldx_bytes);
      _tile_dpbf16ps(6, 1, 2);
      if constexpr (NB == 2) _tile_dpbf16ps(7, 1, 3);
    }
  }
  // sums: [32 rows][2 blocks][16], 128 bytes a row.
  _tile_stored(4, sums, 128);
  if constexpr (NB == 2) _tile_stored(5, sums + 16, 128);
  if constexpr (TWO_ROWS) {
    _tile_stored(6, sums + 16 * 32, 128);
    if constexpr (NB == 2) _tile_stored(7, sums + 16 * 32 + 16, 128);
  }
  store_sums(a, m0, rows0 + rows1, b0, NB, sums, 32);
}

// Whether share() takes the tiles for `a`: whole 32-k steps, and enough rows that the
// multiplies, not the weight stream, could bound the call.
constexpr int64_t kAmxMinRows = 5;
inline bool amx_takes(const Args& a) { return a.K % 32 == 0 && a.M >= kAmxMinRows && amx_permitted(); }

// Weight bytes a thread walks per pass over a chunk of rows: with the chunk's rows (kChunkRows
// x K) they stay in L2.
constexpr int64_t kAmxGroupBytes = 512 << 10;
// Rows of a chunk up to which each pair of blocks takes all its rows in turn (its weights read
// from memory once, kept in L1 for the next row tile: decode); above, each 32 rows take all
// the pairs of a group in turn, so the row tiles stay in L1 and only the weights come from L2
// (prefill: half the L2 traffic per multiply).
constexpr int64_t kAmxPairMajorRows = 64;

template <bool TWO_ROWS>
void amx_tile_blocks(const Args& a, int64_t m, int r0, int r1, int64_t b, bool two, float* sums, Ahead ahead) {
  if (two) amx_tile<TWO_ROWS, 2>(a, m, r0, r1, b, sums, ahead);
  else amx_tile<TWO_ROWS, 1>(a, m, r0, r1, b, sums, ahead);
}

// share()'s walk on tiles: thread t of nt takes its balanced range of blocks, in groups of
// about kAmxGroupBytes, and for each group every chunk of rows, 2 blocks x 32 rows at a time.
// Up to kChunkRows rows (decode) each weight is read from memory once per call.
inline void share_amx(const Args& a, int t, int nt) {
  const int64_t blocks = (a.N + kBlock - 1) / kBlock, block_bytes = a.K * kBlock * (int64_t)sizeof(bf16);
  const int64_t unit = a.swiglu ? 2 : 1, units = blocks / unit;
  const int64_t first = units * t / nt * unit, last = units * (t + 1) / nt * unit;
  if (first >= last) return;
  const int64_t group = kAmxGroupBytes / block_bytes < 2 ? 2 : kAmxGroupBytes / block_bytes / 2 * 2;
  alignas(64) float sums[32 * 32];
  int rows0 = -1, rows1 = -1;
  auto tile = [&](int64_t m, int64_t rows_end, int64_t b, int64_t b_end, Ahead ahead) {
    const int left = (int)(rows_end - m < 32 ? rows_end - m : 32);
    const int r0 = left < 16 ? left : 16, r1 = left - r0;
    if (r0 != rows0 || r1 != rows1) {
      configure(r0, r1);
      rows0 = r0, rows1 = r1;
    }
    if (r1) amx_tile_blocks<true>(a, m, r0, r1, b, b_end - b >= 2, sums, ahead);
    else amx_tile_blocks<false>(a, m, r0, 0, b, b_end - b >= 2, sums, ahead);
  };
  for (int64_t g = first; g < last; g += group) {
    const int64_t g_end = last - g < group ? last : g + group;
    for (int64_t c = 0; c < a.M; c += kChunkRows) {
      const int64_t rows_end = a.M - c < kChunkRows ? a.M : c + kChunkRows;
      if (rows_end - c > kAmxPairMajorRows) {
        for (int64_t m = c; m < rows_end; m += 32)
          for (int64_t b = g; b < g_end; b += 2) tile(m, rows_end, b, g_end, Ahead{});
        continue;
      }
      for (int64_t b = g; b < g_end; b += 2) {
        // The next pair's weights into L2 while this pair's first row tile computes.
        const int64_t next = b + 2, next_nb = last - next < 2 ? last - next : 2;
        const Ahead ahead{(const char*)a.w + next * block_bytes, next < last ? next_nb * block_bytes / 64 : 0};
        for (int64_t m = c; m < rows_end; m += 32) tile(m, rows_end, b, g_end, m == c ? ahead : Ahead{});
      }
    }
  }
  _tile_release();
}
#else
constexpr bool kAmxBuilt = false;
inline bool amx_permitted() { return false; }
inline bool amx_takes(const Args&) { return false; }
inline void share_amx(const Args&, int, int) {}
#endif

}  // namespace pagemill::gemm
