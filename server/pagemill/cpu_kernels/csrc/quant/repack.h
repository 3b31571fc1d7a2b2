// The repacked ("x8") layout the kernels read: the same bytes as the GGUF rows, rearranged
// once at load so that one 32-byte load holds the same 4 elements of 8 output rows.
//
// Why: the product for 8 output rows at once then needs no horizontal sums and no shuffles.
// A vector of 8 rows x 4 consecutive k (in 32-bit lanes) times a broadcast of the activation
// row's 4 int8 values at k (vpmaddubsw + vpmaddwd, or one vpdpbusd) gives each row's partial
// dot product in its own lane, and each lane accumulates one output column in float32, so the
// vector and portable paths make the same float operations in the same order (same bits).
//
// Rows [0, 8 * (N / 8)) are cut into groups of 8 consecutive rows; a group keeps the 8 rows'
// blocks b together, block after block (group g, block b at byte (g * K / elems + b) * 8 *
// block_bytes, so a group's stream is contiguous). The last N % 8 rows stay as GGUF rows after
// the groups; the kernels repack them into a scratch group per call. Inside a group's block
// (c: the row in the group, u: 0..3, "run": 32 consecutive elements, k = 4 i + u within it):
//   d[8], m[8]       f16 scales (and mins / dmins) of the 8 rows, row c at 2 c
//   4-bit run (128 B) byte 32 i + 4 c + u (i 0..3) = q[4i+u] | q[16+4i+u] << 4
//   5th bits (32 B)   byte 4 c + u, bit i = bit 4 of q[4i+u], bit 4 + i = bit 4 of q[16+4i+u]
//   Q6_K high 2 bits  two 32 B halves A, B: byte 4 c + u, bits 2i..2i+1 = q[4i+u] >> 4 (A),
//                     q[16+4i+u] >> 4 (B)
//   8-bit run (256 B) byte 32 i + 4 c + u (i 0..7) = q[4i+u]
//   Q4_K/Q5_K scales  lo[8 j + c] = sc_j & 15 | (m_j & 15) << 4 (64 B), then hi[8 (j & 3) + c]:
//                     bits 0-1 sc_j >> 4, 2-3 sc_{j+4} >> 4, 4-5 m_j >> 4, 6-7 m_{j+4} >> 4
//   Q6_K scales       byte 8 s + c = sc_s (16 x 8 int8)
// Group blocks, with byte offsets (sizes 8 x the GGUF block's):
//   Q8_0 d 0, run 16 | Q4_0 d 0, run 16 | Q4_1 d 0, m 16, run 32 | Q5_0 d 0, bits 16, run 48
//   Q5_1 d 0, m 16, bits 32, run 64 | Q4_K d 0, dmin 16, scales 32, runs 128 (run j at 128 j)
//   Q5_K as Q4_K with bits 128 (32 j), runs 384 | Q6_K d 0, scales 16, high bits 144 (64 j),
//   runs 656 (128 j)
#pragma once
#include <stdint.h>
#include <string.h>

#include "quant/blocks.h"
#include "quant/canon.h"

namespace pagemill::quant {

struct X8 {
  int d, m, scales, bits, runs;  // byte offsets in a group's block; -1 where absent
};

constexpr X8 x8_offsets(int type) {
  switch (type) {
    case kQ8_0: return {0, -1, -1, -1, 16};
    case kQ4_0: return {0, -1, -1, -1, 16};
    case kQ4_1: return {0, 16, -1, -1, 32};
    case kQ5_0: return {0, -1, -1, 16, 48};
    case kQ5_1: return {0, 16, -1, 32, 64};
    case kQ4_K: return {0, 16, 32, -1, 128};
    case kQ5_K: return {0, 16, 32, 128, 384};
    case kQ6_K: return {0, -1, 16, 144, 656};
    default: return {-1, -1, -1, -1, -1};
  }
}

inline int64_t group_block_bytes(int type) { return (int64_t)kGroup * layout(type).bytes; }

// Row c's 32 elements q (low 4 bits, plus bit 4 / bits 4-5) into a group's run and high bits.
inline void put_run4(uint8_t* run, int c, const uint8_t* q) {
  for (int i = 0; i < 4; ++i)
    for (int u = 0; u < 4; ++u) run[32 * i + 4 * c + u] = (uint8_t)((q[4 * i + u] & 15) | (q[16 + 4 * i + u] << 4));
}
inline void get_run4(const uint8_t* run, int c, uint8_t* q) {
  for (int i = 0; i < 4; ++i)
    for (int u = 0; u < 4; ++u) {
      q[4 * i + u] = run[32 * i + 4 * c + u] & 15;
      q[16 + 4 * i + u] = run[32 * i + 4 * c + u] >> 4;
    }
}
inline void put_bit4(uint8_t* bits, int c, const uint8_t* q) {
  for (int u = 0; u < 4; ++u) {
    uint8_t v = 0;
    for (int i = 0; i < 4; ++i) v |= (uint8_t)((((q[4 * i + u] >> 4) & 1) << i) | (((q[16 + 4 * i + u] >> 4) & 1) << (4 + i)));
    bits[4 * c + u] = v;
  }
}
inline void get_bit4(const uint8_t* bits, int c, uint8_t* q) {
  for (int u = 0; u < 4; ++u)
    for (int i = 0; i < 4; ++i) {
      q[4 * i + u] |= (uint8_t)(((bits[4 * c + u] >> i) & 1) << 4);
      q[16 + 4 * i + u] |= (uint8_t)(((bits[4 * c + u] >> (4 + i)) & 1) << 4);
    }
}
inline void put_bits45(uint8_t* bits, int c, const uint8_t* q) {
  for (int u = 0; u < 4; ++u) {
    uint8_t a = 0, b = 0;
    for (int i = 0; i < 4; ++i) {
      a |= (uint8_t)(((q[4 * i + u] >> 4) & 3) << (2 * i));
      b |= (uint8_t)(((q[16 + 4 * i + u] >> 4) & 3) << (2 * i));
    }
    bits[4 * c + u] = a;
    bits[32 + 4 * c + u] = b;
  }
}
inline void get_bits45(const uint8_t* bits, int c, uint8_t* q) {
  for (int u = 0; u < 4; ++u)
    for (int i = 0; i < 4; ++i) {
      q[4 * i + u] |= (uint8_t)(((bits[4 * c + u] >> (2 * i)) & 3) << 4);
      q[16 + 4 * i + u] |= (uint8_t)(((bits[32 + 4 * c + u] >> (2 * i)) & 3) << 4);
    }
}

inline void put_k_scales(uint8_t* s, int c, const Canon& k) {
  for (int j = 0; j < 8; ++j) s[8 * j + c] = (uint8_t)((k.sc[j] & 15) | ((k.mn[j] & 15) << 4));
  for (int j = 0; j < 4; ++j)
    s[64 + 8 * j + c] = (uint8_t)((k.sc[j] >> 4) | ((k.sc[j + 4] >> 4) << 2) | ((k.mn[j] >> 4) << 4) | ((k.mn[j + 4] >> 4) << 6));
}
inline void get_k_scales(const uint8_t* s, int c, Canon& k) {
  for (int j = 0; j < 8; ++j) {
    const int hi = s[64 + 8 * (j & 3) + c] >> (j < 4 ? 0 : 2);
    k.sc[j] = (uint8_t)((s[8 * j + c] & 15) | ((hi & 3) << 4));
    k.mn[j] = (uint8_t)((s[8 * j + c] >> 4) | (((hi >> 4) & 3) << 4));
  }
}

// Row c's canonical block into (put) or out of (get) the group's block g.
template <bool kPut>
void x8_column(int type, uint8_t* g, int c, Canon& k) {
  const X8 o = x8_offsets(type);
  auto half = [&](int off, uint16_t& v) {
    if (off < 0) return;
    if (kPut) memcpy(g + off + 2 * c, &v, 2); else v = load_u16(g + off + 2 * c);
  };  // fmt: skip
  half(o.d, k.d);
  half(o.m, k.m);
  const int runs = layout(type).elems / 32;
  if (type == kQ8_0) {
    for (int i = 0; i < 8; ++i)
      for (int u = 0; u < 4; ++u) {
        uint8_t& b = g[o.runs + 32 * i + 4 * c + u];
        if (kPut) b = k.q[4 * i + u]; else k.q[4 * i + u] = b;
      }  // fmt: skip
    return;
  }
  if (type == kQ4_K || type == kQ5_K) {
    if (kPut) put_k_scales(g + o.scales, c, k); else get_k_scales(g + o.scales, c, k);
  }  // fmt: skip
  if (type == kQ6_K)
    for (int s = 0; s < 16; ++s) {
      if (kPut) g[o.scales + 8 * s + c] = k.sc[s]; else k.sc[s] = g[o.scales + 8 * s + c];
    }  // fmt: skip
  const int bits_stride = type == kQ6_K ? 64 : 32;
  for (int j = 0; j < runs; ++j) {
    uint8_t* q = k.q + 32 * j;
    if (kPut) put_run4(g + o.runs + 128 * j, c, q); else get_run4(g + o.runs + 128 * j, c, q);
    if (o.bits < 0) continue;
    uint8_t* bits = g + o.bits + bits_stride * j;
    if (type == kQ6_K) {
      if (kPut) put_bits45(bits, c, q); else get_bits45(bits, c, q);
    } else {
      if (kPut) put_bit4(bits, c, q); else get_bit4(bits, c, q);
    }  // fmt: skip
  }
}

inline void unpack_column(int type, const uint8_t* g, int c, Canon& k) { x8_column<false>(type, (uint8_t*)g, c, k); }

// Rows src[r] (r < rows <= 8; GGUF rows of row_bytes) block b -> a group's block at g; rows
// past `rows` are zero blocks (scale 0: they add nothing).
inline void pack_group_block(int type, const uint8_t* const* src, int rows, int64_t b, uint8_t* g) {
  const Layout l = layout(type);
  memset(g, 0, (size_t)group_block_bytes(type));
  for (int c = 0; c < kGroup; ++c) {
    Canon k;
    if (c < rows) from_gguf(type, src[c] + b * l.bytes, k);
    x8_column<true>(type, g, c, k);
  }
}

// Rows [8 g, 8 g + rows) of the GGUF matrix src (row_bytes each) -> group g's bytes at dst.
inline void pack_group(int type, const uint8_t* src, int64_t row_bytes, int rows, int64_t K, uint8_t* dst) {
  const uint8_t* r[kGroup];
  for (int c = 0; c < kGroup; ++c) r[c] = src + (c < rows ? c : 0) * row_bytes;
  const int64_t blocks = K / layout(type).elems, gb = group_block_bytes(type);
  for (int64_t b = 0; b < blocks; ++b) pack_group_block(type, r, rows, b, dst + b * gb);
}

}  // namespace pagemill::quant
