// The portable tile, and the readable statement of what the vector tiles compute: each
// column's block is read back into its canonical form (canon.h), its quants multiplied by the
// activation row's int8 values and summed exactly, and the sums scaled with the same float32
// operations, in the same order, as tile_legacy.h / tile_kquants.h do in each lane. So every
// build gives the same bits.
#pragma once
#include <math.h>
#include <stdint.h>

#include "quant/canon.h"
#include "quant/quantize_rows.h"
#include "quant/repack.h"

namespace pagemill::quant::scalar {

// sum_t q[t] * x[t] over n elements; Q8_0's quants are int8, every other type's unsigned.
// One loop per signedness: GCC 12 at -O3 with AVX512-VNNI vectorized the single loop with the
// signedness chosen inside it into wrong sums for the signed case.
inline int32_t dot(const uint8_t* q, const int8_t* x, int n, bool signed_q) {
  int32_t s = 0;
  if (signed_q) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(q);
    for (int t = 0; t < n; ++t) s += (int32_t)qs[t] * x[t];
  } else {
    for (int t = 0; t < n; ++t) s += (int32_t)q[t] * x[t];
  }
  return s;
}

// One 32-element block of column k against row m: the accumulator after it.
inline float legacy_step(int type, const Canon& k, const Acts& a, int64_t m, int64_t b, float acc) {
  const float dx = a.scales(m)[b], dw = half_to_float(k.d);
  const int32_t xsum = a.sums32(m)[b];
  const int off = type == kQ4_0 ? 8 : (type == kQ5_0 ? 16 : 0);
  const int32_t isum = dot(k.q, a.row(m) + 32 * b, 32, type == kQ8_0) - off * xsum;
  acc = fmaf((float)isum, dw * dx, acc);
  if (type == kQ4_1 || type == kQ5_1) acc = fmaf(half_to_float(k.m), dx * (float)xsum, acc);
  return acc;
}

// One super-block of column k against row m: the accumulator after it.
inline float k_step(int type, const Canon& k, const Acts& a, int64_t m, int64_t b, float acc) {
  const float dx = a.scales(m)[b], dw = half_to_float(k.d);
  const int8_t* x = a.row(m) + kQK * b;
  if (type == kQ6_K) {
    const int16_t* xs = a.sums16(m) + 16 * b;
    int32_t isum = 0, corr = 0;
    for (int s = 0; s < 16; ++s) {
      isum += (int8_t)k.sc[s] * dot(k.q + 16 * s, x + 16 * s, 16, false);
      corr += (int8_t)k.sc[s] * xs[s];  // the -32 of every quant, taken out in one product
    }
    return fmaf((float)(isum - 32 * corr), dw * dx, acc);
  }
  const int16_t* xs = a.sums32(m) + 8 * b;
  int32_t isum = 0, msum = 0;
  for (int j = 0; j < 8; ++j) {
    isum += k.sc[j] * dot(k.q + 32 * j, x + 32 * j, 32, false);
    msum += k.mn[j] * xs[j];
  }
  acc = fmaf((float)isum, dw * dx, acc);
  return fmaf((float)msum, half_to_float(k.m) * -dx, acc);
}

// Rows [r0, r0 + mr) (mr <= 4) x the group at gp (K / elems blocks) -> out[r][c].
inline void tile(int type, const uint8_t* gp, int64_t blocks, const Acts& a, int64_t r0, int mr, float (*out)[8]) {
  const int64_t gb = group_block_bytes(type);
  float acc[4][kGroup] = {};
  Canon k;
  for (int64_t b = 0; b < blocks; ++b)
    for (int c = 0; c < kGroup; ++c) {
      unpack_column(type, gp + b * gb, c, k);
      for (int r = 0; r < mr; ++r)
        acc[r][c] = is_k_quant(type) ? k_step(type, k, a, r0 + r, b, acc[r][c]) : legacy_step(type, k, a, r0 + r, b, acc[r][c]);
    }
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < kGroup; ++c) out[r][c] = acc[r][c];
}

}  // namespace pagemill::quant::scalar
