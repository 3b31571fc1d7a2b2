// What the AMX tile paths of the linears share (gemm_amx.h: bf16, int8_amx.h:
// int8): the process's permission, the tile configuration, and the walk of
// one thread's blocks and rows.
//
// Both weight layouts are already AMX's B-tile ("VNNI") form: a block of 16
// output channels is [K / pack][16][pack] (pack = 2 bf16 or 4 int8), so a B
// tile is 16 consecutive 64-byte rows of a block: 32 k of bf16 or 64 k of
// int8 for 16 outputs. A tiles are 16 activation rows x 64 bytes, read in
// place. Each step keeps 2 row tiles (32 rows) x 2 blocks (32 outputs) in the
// 4 accumulator tiles, so every weight row loaded serves 32 rows.
//
// Linux grants a process the tiles' register state only on request
// (arch_prctl); where it refuses, the callers keep their AVX-512 paths.
#pragma once
#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEMILL_AMX_TILE 1
#endif

namespace pagemill::amx {

#if defined(PAGEMILL_AMX_TILE)
// Whether this process may use the tiles (asked once; the grant is process-wide).
inline bool permitted() {
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

// Rows in the first and second row tile (1..16 and 0..16); every tile is 64 bytes wide.
inline void configure(int rows0, int rows1) {
  TileConfig c;
  const int r1 = rows1 ? rows1 : 1;
  const int rows[8] = {rows0, r1, 16, 16, rows0, rows0, r1, r1};
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = (uint8_t)rows[i];
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}
#else
inline bool permitted() { return false; }
#endif

// Weight lines of the next pair of blocks a tile asks for into L2 while it computes.
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0;
};

// Weight bytes a thread walks per pass over a chunk of rows: with the chunk's rows they stay
// in L2, so the row tiles are not re-read from L3 for every pair of blocks.
constexpr int64_t kGroupBytes = 512 << 10;
// Rows of a chunk up to which each pair of blocks takes all its rows in turn (its weights read
// from memory once, kept in L1 for the next row tile: decode); above, each 32 rows take all
// the pairs of a group in turn, so the row tiles stay in L1 and only the weights come from L2
// (prefill: half the L2 traffic per multiply).
constexpr int64_t kPairMajorRows = 64;

// How a pair of blocks walks a chunk of up to kPairMajorRows rows: one pass of rows0 + rows1
// rows, or two of the same shape, the second ending at the chunk's last row (they share a row
// where the count is odd; its sums come out the same either pass). One shape for both passes
// keeps the tile configuration: a 33-63-row chunk walked as 32 rows then the rest changed it
// twice a pair of blocks, and ldtilecfg is slow (a 48-row gate_up took 1.07x, the LM head
// 1.09x; docs/cpu.md).
struct Passes {
  int rows0, rows1;
  bool second;
};
inline Passes passes(int rows) {
  if (rows <= 32) return {rows < 16 ? rows : 16, rows <= 16 ? 0 : rows - 16, false};
  return {16, (rows - 32 + 1) / 2, true};
}

// One thread's blocks [first, last) of `weights` (block_bytes each) against rows [0, M),
// chunk_rows at a time, in groups of about kGroupBytes: tile(m, rows0, rows1, b, two_blocks,
// ahead) computes rows [m, m + rows0 + rows1) x blocks b (and b + 1 where two_blocks).
// Configures the tiles as the row counts change and releases them at the end. Up to
// chunk_rows rows (decode) each weight is read from memory once per call.
#if defined(PAGEMILL_AMX_TILE)
template <class Tile>
void walk(const void* weights, int64_t first, int64_t last, int64_t M, int64_t chunk_rows, int64_t block_bytes,
          Tile&& tile) {
  if (first >= last) return;
  const int64_t group = kGroupBytes / block_bytes < 2 ? 2 : kGroupBytes / block_bytes / 2 * 2;
  int rows0 = -1, rows1 = -1;
  auto run = [&](int64_t m, int r0, int r1, int64_t b, int64_t b_end, Ahead ahead) {
    if (r0 != rows0 || r1 != rows1) {
      configure(r0, r1);
      rows0 = r0, rows1 = r1;
    }
    tile(m, r0, r1, b, b_end - b >= 2, ahead);
  };
  for (int64_t g = first; g < last; g += group) {
    const int64_t g_end = last - g < group ? last : g + group;
    for (int64_t c = 0; c < M; c += chunk_rows) {
      const int64_t rows_end = M - c < chunk_rows ? M : c + chunk_rows;
      if (rows_end - c > kPairMajorRows) {
        for (int64_t m = c; m < rows_end; m += 32) {
          const int left = (int)(rows_end - m < 32 ? rows_end - m : 32), r0 = left < 16 ? left : 16;
          for (int64_t b = g; b < g_end; b += 2) run(m, r0, left - r0, b, g_end, Ahead{});
        }
        continue;
      }
      const Passes p = passes((int)(rows_end - c));
      for (int64_t b = g; b < g_end; b += 2) {
        // The next pair's weights into L2 while this pair's first row tile computes.
        const int64_t next = b + 2, next_nb = last - next < 2 ? last - next : 2;
        const Ahead ahead{(const char*)weights + next * block_bytes, next < last ? next_nb * block_bytes / 64 : 0};
        run(c, p.rows0, p.rows1, b, g_end, ahead);
        if (p.second) run(rows_end - (p.rows0 + p.rows1), p.rows0, p.rows1, b, g_end, Ahead{});
      }
    }
  }
  _tile_release();
}

// The multiplies of one walk step: rows [0, 16) (and [16, 32) where TWO_ROWS) of `x` (rows
// ldx bytes apart) against blocks 0 (and 1 where NB == 2) of `w` (block_bytes apart), `steps`
// steps of 64 bytes of k, summed by Dp::dp<C>(), the element type's tile product into sums
// tile C (4: row tile 0 x block 0, 5: 0 x 1, 6: 1 x 0, 7: 1 x 1); ahead's lines asked for into
// L2 along the way. store() then writes the sums: [32 rows][2 blocks][16] 4-byte lanes, 128
// bytes a row. kStreamW: the weight tiles load with the streaming hint (tileloaddt1), so they
// do not push the activation rows out of L1 (see gemm_amx.h).
template <class Dp, bool TWO_ROWS, int NB, bool kStreamW = false>
void multiply(const char* w, int64_t block_bytes, const char* x, int64_t ldx, int64_t steps, Ahead ahead) {
  const int64_t per = (ahead.lines + steps - 1) / steps;  // lines asked for per step
  const char* x1 = x + 16 * ldx;
  _tile_zero(4);
  if constexpr (NB == 2) _tile_zero(5);
  if constexpr (TWO_ROWS) {
    _tile_zero(6);
    if constexpr (NB == 2) _tile_zero(7);
  }
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t q = s * per; q < (s + 1) * per && q < ahead.lines; ++q) _mm_prefetch(ahead.p + 64 * q, _MM_HINT_T1);
    if constexpr (kStreamW) {
      _tile_stream_loadd(2, w + s * 1024, 64);
      if constexpr (NB == 2) _tile_stream_loadd(3, w + block_bytes + s * 1024, 64);
    } else {
      _tile_loadd(2, w + s * 1024, 64);
      if constexpr (NB == 2) _tile_loadd(3, w + block_bytes + s * 1024, 64);
    }
    _tile_loadd(0, x + s * 64, ldx);
    Dp::template dp<4>();
    if constexpr (NB == 2) Dp::template dp<5>();
    if constexpr (TWO_ROWS) {
      _tile_loadd(1, x1 + s * 64, ldx);
      Dp::template dp<6>();
      if constexpr (NB == 2) Dp::template dp<7>();
    }
  }
}

template <bool TWO_ROWS, int NB>
void store(void* sums) {
  char* p = (char*)sums;
  _tile_stored(4, p, 128);
  if constexpr (NB == 2) _tile_stored(5, p + 64, 128);
  if constexpr (TWO_ROWS) {
    _tile_stored(6, p + 16 * 128, 128);
    if constexpr (NB == 2) _tile_stored(7, p + 16 * 128 + 64, 128);
  }
}
#endif

}  // namespace pagemill::amx
