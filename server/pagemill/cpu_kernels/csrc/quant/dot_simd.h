// The vector steps the repacked kernels (tile_legacy.h, tile_kquants.h) are written in, on
// 256-bit vectors of 8 output columns (repack.h's 32-bit lanes), in two builds:
//
// - AVX2: vpmaddubsw multiplies unsigned weight bytes by signed activation bytes and adds
//   pairs into int16; the int16 partials are widened to int32 by vpmaddwd, against ones or
//   against the column's sub-block scale (which then costs nothing). int16 holds at most
//   32767, so a Sum takes a bounded number of products before it must be flushed: 8 for 4-bit
//   quants (2 * 15 * 127 each), 4 for 5-bit, 2 for 6-bit, 1 for Q8_0 (128 * 127 * 2).
// - VNNI (AVX512-VNNI with AVX512VL, or AVX-VNNI): vpdpbusd does the same products straight
//   into int32, and a scale multiplies the int32 partial (vpmulld). The kernels flush at the
//   same points, so both builds run the same code and give the same integers.
//
// Q8_0's weights are signed: on AVX2, like ggml, the weight's magnitude is the unsigned operand
// and the activation takes the weight's sign (vpsignb), which is exact; with VNNI the
// activations are offset to unsigned instead (tile_legacy.h), the same integers.
//
// PAGEMILL_QUANT_SIMD is set where AVX2, FMA and F16C are all compiled in and the portable
// path is not forced (-DPAGEMILL_QUANT_PORTABLE, for tests); else tile_scalar.h runs.
// -DPAGEMILL_QUANT_EMULATE_VNNI builds the VNNI code with vpdpbusd emulated exactly in AVX2,
// so that an AVX2 machine can test it.
#pragma once
#include <stdint.h>
#include <string.h>

#include "quant/blocks.h"

#if !defined(PAGEMILL_QUANT_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEMILL_QUANT_SIMD 1
#include <immintrin.h>
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__) || defined(PAGEMILL_QUANT_EMULATE_VNNI)
#define PAGEMILL_QUANT_VNNI 1
#endif
#endif

#if defined(PAGEMILL_QUANT_SIMD)
namespace pagemill::quant::simd {

inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64((const __m128i*)p); }
// 8 f16 values at p (the 8 columns' scales) as float32.
inline __m256 halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
// The activation row's 4 bytes at x in every lane.
inline __m256i bcast4(const int8_t* x) {
  int32_t v;
  memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}
// Two int16 values at s (consecutive activation sums) in every 32-bit lane.
inline __m256i bcast_pair(const int16_t* s) { return bcast4((const int8_t*)s); }

inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline __m256i high4(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
// Bit `bit` (0..7) of every byte of h moved to bit 4 (the 5th bit of a quant), others cleared:
// a 16-bit shift moves both bytes' bits alike, and the mask drops what crossed between them.
inline __m256i bit_to_4(__m256i h, int bit) {
  const __m256i s = bit <= 4 ? _mm256_slli_epi16(h, 4 - bit) : _mm256_srli_epi16(h, bit - 4);
  return _mm256_and_si256(s, _mm256_set1_epi8(0x10));
}
// Bits `bit`, `bit` + 1 of every byte of h moved to bits 4-5 (Q6_K's high bits).
inline __m256i bits_to_45(__m256i h, int bit) {
  const __m256i s = bit <= 4 ? _mm256_slli_epi16(h, 4 - bit) : _mm256_srli_epi16(h, bit - 4);
  return _mm256_and_si256(s, _mm256_set1_epi8(0x30));
}

// Per-column int16 pairs (a_c, b_c) from 8 bytes at a and 8 at b, for vpmaddwd against a
// broadcast pair of activation sums (the K-quants' min and offset terms).
inline __m256i pairs_u8(const uint8_t* a, const uint8_t* b) {
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(load8(a), load8(b)));
}
inline __m256i pairs_i8(const uint8_t* a, const uint8_t* b) {
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(load8(a), load8(b)));
}

#if defined(PAGEMILL_QUANT_VNNI)
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(PAGEMILL_QUANT_EMULATE_VNNI)
  // vpdpbusd exactly, from AVX2 (tests only: runs the VNNI build's code on an AVX2 machine):
  // the even and the odd bytes widened to int16, each vpmaddwd adding two exact products.
  const __m256i lo8 = _mm256_set1_epi16(0xff);
  const __m256i even = _mm256_madd_epi16(_mm256_and_si256(u, lo8), _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8));
  const __m256i odd = _mm256_madd_epi16(_mm256_srli_epi16(u, 8), _mm256_srai_epi16(s, 8));
  return _mm256_add_epi32(acc, _mm256_add_epi32(even, odd));
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}

// One output row's int32 sums for 8 columns: products into `part`, flushed into `total`.
struct Sum {
  __m256i part = _mm256_setzero_si256(), total = _mm256_setzero_si256();
  // xb: 4 activation bytes in every lane (bcast4), shared by the groups of a tile
  void add(__m256i w, __m256i xb) { part = dpbusd(part, w, xb); }
  void add_signed(__m256i w_abs, __m256i w, __m256i xb) { part = dpbusd(part, w_abs, _mm256_sign_epi8(xb, w)); }
  void flush() {
    total = _mm256_add_epi32(total, part);
    part = _mm256_setzero_si256();
  }
  void flush(__m256i scale) {  // scale: scales_u8 / scales_i8
    total = _mm256_add_epi32(total, _mm256_mullo_epi32(part, scale));
    part = _mm256_setzero_si256();
  }
};

// 8 per-column scales (bytes at s) in the form Sum::flush(scale) takes.
inline __m256i scales_u8(const uint8_t* s) { return _mm256_cvtepu8_epi32(load8(s)); }
inline __m256i scales_i8(const uint8_t* s) { return _mm256_cvtepi8_epi32(load8(s)); }
#else
// GCC re-associates a chain of vpaddw: it computed every product of a tile first and spilled
// them all (measured: 32 vpmaddubsw and their stores ahead of the adds). An empty asm on the
// running sum keeps each product added as it is made, in registers.
inline __m256i keep(__m256i v) {
  __asm__("" : "+x"(v));
  return v;
}

struct Sum {
  __m256i part = _mm256_setzero_si256(), total = _mm256_setzero_si256();  // part: int16 pairs
  // xb: 4 activation bytes in every lane (bcast4), shared by the groups of a tile
  void add(__m256i w, __m256i xb) { part = keep(_mm256_add_epi16(part, _mm256_maddubs_epi16(w, xb))); }
  void add_signed(__m256i w_abs, __m256i w, __m256i xb) {
    part = keep(_mm256_add_epi16(part, _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xb, w))));
  }
  void flush() {
    total = _mm256_add_epi32(total, _mm256_madd_epi16(part, _mm256_set1_epi16(1)));
    part = _mm256_setzero_si256();
  }
  void flush(__m256i scale) {  // scale: each column's scale twice, as int16 (scales_u8 / scales_i8)
    total = _mm256_add_epi32(total, _mm256_madd_epi16(part, scale));
    part = _mm256_setzero_si256();
  }
};

// Bytes 0..7 -> 0,0,1,1,..,7,7: each column's scale for both int16 of its lane.
inline __m128i twice(__m128i b) { return _mm_shuffle_epi8(b, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)); }
inline __m256i scales_u8(const uint8_t* s) { return _mm256_cvtepu8_epi16(twice(load8(s))); }
inline __m256i scales_i8(const uint8_t* s) { return _mm256_cvtepi8_epi16(twice(load8(s))); }
#endif

// sum_k vpmaddwd(pairs[k], sums[2k], sums[2k+1]): int32 per column.
inline __m256i pair_products(const __m256i* pairs, const int16_t* sums, int n) {
  __m256i t = _mm256_setzero_si256();
  for (int k = 0; k < n; ++k) t = _mm256_add_epi32(t, _mm256_madd_epi16(pairs[k], bcast_pair(sums + 2 * k)));
  return t;
}

// Asks for the line `ahead` bytes past each 64 of [p, p + n): the next blocks of a weight stream
// (the L2 streamer alone restarts at every 4 KiB page; vec.h's kWeightAhead says more).
inline void ask_ahead(const uint8_t* p, int64_t n, int64_t ahead) {
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch((const char*)p + ahead + o, _MM_HINT_T0);
}

}  // namespace pagemill::quant::simd
#endif
