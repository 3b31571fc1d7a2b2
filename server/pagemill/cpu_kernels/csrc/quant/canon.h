// One GGUF block read into a canonical form: its scales as stored and its quants as small
// unsigned integers (Q8_0: int8 bits), one per element in natural order. The repacked layout
// (repack.h) is written from and read back into this form, the portable kernel (tile_scalar.h)
// multiplies it, and dequantization reads it with the same float operations as gguf-py's
// gguf.quants.dequantize, so the two agree to the bit.
#pragma once
#include <stdint.h>
#include <string.h>

#include "quant/blocks.h"

namespace pagemill::quant {

struct Canon {
  uint16_t d = 0;  // f16 bits: the block's scale (K-quants: the super-block's)
  uint16_t m = 0;  // f16 bits: Q4_1/Q5_1's min, Q4_K/Q5_K's dmin
  uint8_t q[kQK] = {};  // quants: 0..15 (4-bit), 0..31 (5-bit), 0..63 (Q6_K), int8 bits (Q8_0)
  uint8_t sc[16] = {};  // Q4_K/Q5_K: 8 six-bit scales; Q6_K: 16 int8 scales
  uint8_t mn[8] = {};  // Q4_K/Q5_K: 8 six-bit mins
};

// 32 quants from 16 bytes of nibbles: low nibble of byte t is element t, high element t + 16.
inline void nibbles_32(const uint8_t* qs, uint8_t* q) {
  for (int t = 0; t < 16; ++t) {
    q[t] = qs[t] & 15;
    q[t + 16] = qs[t] >> 4;
  }
}

inline void legacy_from_gguf(int type, const uint8_t* b, Canon& c) {
  c.d = load_u16(b);
  if (type == kQ8_0) {
    memcpy(c.q, b + 2, 32);
    return;
  }
  const bool with_min = type == kQ4_1 || type == kQ5_1, five = type == kQ5_0 || type == kQ5_1;
  if (with_min) c.m = load_u16(b + 2);
  const uint8_t* p = b + (with_min ? 4 : 2);
  uint32_t qh = 0;
  if (five) {
    qh = load_u32(p);
    p += 4;
  }
  nibbles_32(p, c.q);
  if (five)
    for (int t = 0; t < 32; ++t) c.q[t] |= (uint8_t)(((qh >> t) & 1) << 4);
}

// Q4_K/Q5_K's 12 scale bytes: scales and mins 0-3 in the low 6 bits of bytes 0-3 and 4-7;
// 4-7 as a nibble of bytes 8-11 plus the top 2 bits of bytes 0-3 (scales) or 4-7 (mins).
inline void k_scales_from_gguf(const uint8_t* s, Canon& c) {
  for (int j = 0; j < 4; ++j) {
    c.sc[j] = s[j] & 63;
    c.mn[j] = s[j + 4] & 63;
    c.sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
    c.mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}

inline void k_from_gguf(int type, const uint8_t* b, Canon& c) {
  if (type == kQ6_K) {  // ql[128] qh[64] scales[16] d: halves of 128, each four runs of 32
    const uint8_t *ql = b, *qh = b + 128;
    memcpy(c.sc, b + 192, 16);
    c.d = load_u16(b + 208);
    for (int e = 0; e < kQK; ++e) {
      const int h = e >> 7, r = e & 127;
      const int lo = (ql[64 * h + (r & 63)] >> (4 * (r >> 6))) & 15;
      const int hi = (qh[32 * h + (r & 31)] >> (2 * (r >> 5))) & 3;
      c.q[e] = (uint8_t)(lo | (hi << 4));
    }
    return;
  }
  c.d = load_u16(b);
  c.m = load_u16(b + 2);
  k_scales_from_gguf(b + 4, c);
  const bool five = type == kQ5_K;
  const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
  for (int j2 = 0; j2 < 4; ++j2)  // 64 elements per 32 bytes: low nibbles, then high
    for (int t = 0; t < 32; ++t) {
      uint8_t lo = qs[32 * j2 + t] & 15, hi = qs[32 * j2 + t] >> 4;
      if (five) {
        lo |= (uint8_t)(((qh[t] >> (2 * j2)) & 1) << 4);
        hi |= (uint8_t)(((qh[t] >> (2 * j2 + 1)) & 1) << 4);
      }
      c.q[64 * j2 + t] = lo;
      c.q[64 * j2 + 32 + t] = hi;
    }
}

// The GGUF block at b (a quantized type) -> c.
inline void from_gguf(int type, const uint8_t* b, Canon& c) {
  if (is_k_quant(type))
    k_from_gguf(type, b, c);
  else
    legacy_from_gguf(type, b, c);
}

// c's layout(type).elems weights as float32, rounded as gguf-py's dequantize_blocks: each
// product rounded before the following sum (mul_rounded), in numpy's order.
inline void dequant(int type, const Canon& c, float* out) {
  const float d = half_to_float(c.d), m = half_to_float(c.m);
  switch (type) {
    case kQ8_0: for (int t = 0; t < 32; ++t) out[t] = (float)(int8_t)c.q[t] * d; return;
    case kQ4_0: for (int t = 0; t < 32; ++t) out[t] = d * (float)(c.q[t] - 8); return;
    case kQ5_0: for (int t = 0; t < 32; ++t) out[t] = d * (float)(c.q[t] - 16); return;
    case kQ4_1:
    case kQ5_1: for (int t = 0; t < 32; ++t) out[t] = mul_rounded(d, (float)c.q[t]) + m; return;
    case kQ6_K:
      for (int e = 0; e < kQK; ++e) out[e] = (d * (float)(int8_t)c.sc[e / 16]) * (float)(c.q[e] - 32);
      return;
    default:  // Q4_K, Q5_K
      for (int e = 0; e < kQK; ++e) {
        const float dl = d * (float)c.sc[e / 32], ml = mul_rounded(m, (float)c.mn[e / 32]);
        out[e] = mul_rounded(dl, (float)c.q[e]) - ml;
      }
  }
}

}  // namespace pagemill::quant
