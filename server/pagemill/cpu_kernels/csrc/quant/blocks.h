// GGUF weight types as ggml numbers and lays them out, and the scalar number conversions the
// quant kernels share (half and bfloat16 to and from float32, rounding as ggml and numpy do).
//
// A GGUF 2-d weight [N, K] is N rows of K / block_elems blocks each; the blocks hold
// (ggml-common.h's structs, little-endian, no padding):
//   Q8_0  34 B / 32: d (f16), qs[32] int8                     w = d * q
//   Q4_0  18 B / 32: d, qs[16]: q[t] | q[t+16] << 4           w = d * (q - 8)
//   Q4_1  20 B / 32: d, m (f16), qs[16]                       w = d * q + m
//   Q5_0  22 B / 32: d, qh (u32: bit t = bit 4 of q[t]), qs   w = d * (q - 16)
//   Q5_1  24 B / 32: d, m, qh, qs                             w = d * q + m
//   Q4_K 144 B / 256: d, dmin (f16), scales[12] (8 six-bit scales and 8 mins), qs[128]
//                     (per 64: 32 bytes, low nibbles the first 32, high the next)
//                                                             w = d * sc_j * q - dmin * m_j
//   Q5_K 176 B / 256: d, dmin, scales[12], qh[32] (bit j of qh[t]: element 32 j + t), qs[128]
//   Q6_K 210 B / 256: ql[128], qh[64], scales[16] (int8, one per 16), d
//                                                             w = d * sc_s * (q - 32)
// canon.h reads each of them into one canonical form.
#pragma once
#include <stdint.h>
#include <string.h>

namespace pagemill::quant {

enum Type : int {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};  // fmt: skip

constexpr int kQK = 256;  // elements of a K-quant super-block
constexpr int kGroup = 8;  // output rows a repacked group interleaves (repack.h)

struct Layout {
  int elems;  // elements per block (1 for the float types)
  int bytes;  // bytes per block; 0: not a supported type
};

inline Layout layout(int type) {
  switch (type) {
    case kF32: return {1, 4};
    case kF16: return {1, 2};
    case kBF16: return {1, 2};
    case kQ8_0: return {32, 34};
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ4_K: return {kQK, 144};
    case kQ5_K: return {kQK, 176};
    case kQ6_K: return {kQK, 210};
    default: return {0, 0};
  }
}

inline bool supported(int type) { return layout(type).bytes > 0; }
inline bool is_float(int type) { return type == kF32 || type == kF16 || type == kBF16; }
inline bool is_k_quant(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

// Bytes of one row of K elements; 0 where K is not a whole number of blocks.
inline int64_t row_bytes(int type, int64_t K) {
  const Layout l = layout(type);
  if (l.bytes == 0 || K <= 0 || K % l.elems != 0) return 0;
  return K / l.elems * l.bytes;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

inline float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

// IEEE half -> float, exact (subnormals, infinities and NaN included), as F16C's vcvtph2ps.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
  const float sub = (float)mant * 0x1p-24f;  // a subnormal half: mant * 2^-24, exact in float
  return sign ? -sub : sub;
}

// float -> IEEE half, rounding to nearest even, as F16C's vcvtps2ph and numpy's astype(float16).
inline uint16_t float_to_half(float f) {
  const uint32_t u = float_to_bits(f), sign = (u >> 16) & 0x8000;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff));  // NaN stays NaN
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  // rounds past 65504: infinity
  if (a < 0x38800000u) {  // below 2^-14: a half subnormal (or zero), mant = round(|f| * 2^24)
    const uint32_t shift = 126 - (a >> 23);  // 14 + (113 - exponent) bits go
    if (shift > 24) return (uint16_t)sign;
    const uint32_t m = (a & 0x7fffff) | 0x800000;
    const uint32_t half = 1u << (shift - 1), rest = m & ((1u << shift) - 1);
    uint32_t r = m >> shift;
    if (rest > half || (rest == half && (r & 1))) ++r;
    return (uint16_t)(sign | r);
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1);  // round the 13 dropped bits to nearest even
  return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

// float -> bfloat16, nearest even, NaN kept quiet (torch's .to(bfloat16)).
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// a * b rounded to float32 before it is used: GCC contracts a * b - c into one FMA even in ISO
// mode, and gguf-py's dequantize (the reference) rounds the product first.
inline float mul_rounded(float a, float b) {
  float p = a * b;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(p));  // an opaque use: the product is materialized, not fused
#else
  volatile float v = p;
  p = v;
#endif
  return p;
}

}  // namespace pagemill::quant
