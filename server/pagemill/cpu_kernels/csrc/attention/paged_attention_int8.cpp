// Paged attention over an int8 KV cache (--kv-cache-dtype int8): rows of
// head_dim int8 entries, each followed by its float32 scale
// (attention/kv_dtype.py), dequantized as they are read (paged_attention.h).
// A file of its own so that decode.cpp, whose fused layer takes only pools
// in the weights' dtype, stays as it is.
#include <stdint.h>

#include "attention/paged_attention.h"
#include "common/vec.h"

extern "C" {

// q and out float32 (q_bf16 0) or bfloat16 (1); the rest as pagemill_paged_attention.
int pagemill_paged_attention_int8(const void* q, int q_bf16, int64_t q_stride, const void* k_cache,
                                  const void* v_cache, const int32_t* block_tables, int64_t width,
                                  const int32_t* context_lens, void* out, int64_t B, int64_t nh, int64_t nkv,
                                  int64_t D, int64_t bs, float scale, int64_t window, int threads) {
  using pagemill::attend_batch;
  using pagemill::bf16;
  using pagemill::q8;
  if (q_bf16)
    return attend_batch<bf16, q8>((const bf16*)q, q_stride, (const q8*)k_cache, (const q8*)v_cache, block_tables,
                                  width, context_lens, (bf16*)out, B, nh, nkv, D, bs, scale, window, threads);
  return attend_batch<float, q8>((const float*)q, q_stride, (const q8*)k_cache, (const q8*)v_cache, block_tables,
                                 width, context_lens, (float*)out, B, nh, nkv, D, bs, scale, window, threads);
}

}  // extern "C"
