// The new tokens' keys and values written into their KV pool slots, both in
// one call: a row copy per token, no cast (the pool holds the model's dtype).
//
// Why: torch spent two index_copy_ per layer on it (one for k, one for v),
// each with its own dispatch, checks and output bookkeeping: ~40 us of a
// 16-sequence bf16 decode layer on one core, for 24 KiB of copying.
// Pools of another dtype (fp8, int8) keep torch's casting path
// (attention/kv_dtype.py).
#include <stdint.h>
#include <string.h>

extern "C" {

// For each token t < T: k_cache row slots[t] = the row_bytes at k + t * k_stride, and the same
// for v (strides and row_bytes in bytes; a cache row: one slot's kv heads, contiguous).
// Returns 0, or 1 + t for the first token whose slot is outside [0, num_slots) (nothing is
// written for it or after it).
int64_t pagemill_write_kv(const uint8_t* k, int64_t k_stride, const uint8_t* v, int64_t v_stride, int64_t T,
                          int64_t row_bytes, const int64_t* slots, int64_t num_slots, uint8_t* k_cache,
                          uint8_t* v_cache) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || s >= num_slots) return 1 + t;
    memcpy(k_cache + s * row_bytes, k + t * k_stride, row_bytes);
    memcpy(v_cache + s * row_bytes, v + t * v_stride, row_bytes);
  }
  return 0;
}
}
