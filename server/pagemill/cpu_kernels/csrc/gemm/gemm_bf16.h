// The bfloat16 linear at 2..a few hundred rows: y[M, N] = x[M, K] @ w[N, K]^T
// (+ bias), bf16 in and out, float32 sums (AVX512-BF16's vdpbf16ps).
//
// Why our own: oneDNN's packed bf16 inner product (what torch runs) measured
// at 25-35% of this core's vdpbf16ps rate at 8-32 rows in a decode step, and
// its weight stream ran well below memory speed, so a batch-16 step of the
// default model took 3x its floor. This is the micro-kernel of
// int8_rows.h with bf16 pairs instead of int8 quads.
//
// Weight layout (packed once at load, models/packed_linear.py): N padded to
// 16 and K to 2, then [N/16][K/2][16][2]: for each pair of k, the 16 output
// channels of a block sit in one 64-byte vector, two consecutive k per
// 32-bit lane, which is what vdpbf16ps multiplies against a broadcast of two
// activations. A tile keeps 4 blocks (64 outputs) x up to 6 rows in 24
// accumulator registers, so each weight vector loaded serves 6 rows (64 rows
// are bound by the multiplies, not the loads), and at few rows the weights
// stream from 4 sequential blocks.
//
// Threads split the blocks evenly; each walks all rows for its blocks, so
// the weights are read from memory once per call whatever the row count up
// to kChunkRows; beyond it (prefill) the rows go in chunks that stay in L2
// while the thread's blocks stream past them again.
//
// Without AVX512-BF16 a portable loop over the same layout computes the
// same sums in float32 (tests build it with the instructions disabled);
// models/packed_linear.py only picks this kernel where the fast path exists.
//
// SwiGLU (Args::swiglu, AVX512-BF16 only): an MLP's gate_up weight packed
// with its gate and up blocks interleaved (block 2i: gate channels
// 16i..16i+15, block 2i+1: the same up channels; gemm.py's pack_swiglu), so
// that a tile holds both halves of its outputs and writes
// silu(gate) * up [M, N/2] instead of gate_up [M, N]: no second pass over a
// [M, 2I] intermediate. The roundings are those of the two passes
// (bf16_row_ops.h's silu_mul_row on the bf16 gate_up), bit for bit.
#pragma once
#include <omp.h>
#include <stdint.h>

#include "common/team_balance.h"
#include "gemm/gemm_amx.h"  // share_amx: the same call on AMX tiles
#include "gemm/gemm_tile.h"

namespace pagemill::gemm {

// One thread's share: thread t of nt takes a contiguous, balanced range of
// blocks and walks every row of a chunk for each group of kTileBlocks. The
// group's first row tile streams its weights from memory; the tiles of a
// group ask for the next group's weights into L2 along the way, so that its
// first tile finds them there (at 16-64 rows the weights' stream was not
// hidden behind the multiplies).
constexpr int64_t kMinAheadTiles = 3;
constexpr int64_t kMaxAheadBytes = 128 << 10;

inline void share(const Args& a, int t, int nt) {
  const balance::Busy busy(a.balance, t, nt);
  if (amx_takes(a)) return share_amx(a, t, nt);
  const int64_t blocks = (a.N + kBlock - 1) / kBlock, block_bytes = a.K * kBlock * (int64_t)sizeof(bf16);
  // Under swiglu a thread's range holds whole (gate, up) pairs, so every tile does.
  const int64_t unit = a.swiglu ? 2 : 1, units = blocks / unit;
  const int64_t first = balance::bound(a.balance, units, t, nt) * unit;
  const int64_t last = balance::bound(a.balance, units, t + 1, nt) * unit;
  for (int64_t c = 0; c < a.M; c += kChunkRows) {
    const int64_t rows_end = a.M - c < kChunkRows ? a.M : c + kChunkRows;
    const int64_t tiles = (rows_end - c + kTileRows - 1) / kTileRows;
    for (int64_t b = first; b < last; b += kTileBlocks) {
      const int nb = (int)(last - b < kTileBlocks ? last - b : kTileBlocks);
      const int64_t next = b + kTileBlocks, next_nb = last - next < kTileBlocks ? last - next : kTileBlocks;
      // Not below kMinAheadTiles tiles (the group's own stream then fills the miss queue:
      // 0.86-0.94x at 8 rows), nor for groups above kMaxAheadBytes (K = 1536: 0.95-1.0x).
      const int64_t bytes = next_nb * block_bytes;
      const int64_t lines = next < last && tiles >= kMinAheadTiles && bytes <= kMaxAheadBytes ? bytes / 64 : 0;
      const char* next_w = (const char*)(a.w + next * (block_bytes / (int64_t)sizeof(bf16)));
      for (int64_t m = c, i = 0; m < rows_end; m += kTileRows, ++i) {
        const int mr = (int)(rows_end - m < kTileRows ? rows_end - m : kTileRows);
        const int64_t l0 = i * lines / tiles, l1 = (i + 1) * lines / tiles;
        tile_any(a, m, mr, b, nb, Ahead{next_w + 64 * l0, l1 - l0});
      }
    }
  }
}

}  // namespace pagemill::gemm
