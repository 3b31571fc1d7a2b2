// Paged attention of prompt chunks, float32 or bfloat16 queries over a pool
// of the same dtype (prefill_attention.h). A file of its own: decode.cpp's
// entry points stay as they are.
#include <stdint.h>

#include "attention/prefill_attention.h"
#include "common/vec.h"

extern "C" {

// q [T, nh, D] (tokens q_stride apart, heads contiguous) and out [T, nh, D]
// float32 (q_bf16 0) or bfloat16 (1), caches [blocks, bs, nkv, D] of the same
// dtype; cu_q [B + 1] int32 (sequence b's new tokens are rows cu_q[b]..cu_q[b+1]-1),
// kv_lens [B] int32 (its keys after this step, the new ones included),
// block_tables [B, width] int32. window > 0: a query sees only its last `window` keys.
// Returns 1 when nh is not a multiple of nkv, 2 when a sequence has fewer keys than new tokens.
int pagemill_prefill_attention(const void* q, int q_bf16, int64_t q_stride, const void* k_cache, const void* v_cache,
                               const int32_t* block_tables, int64_t width, const int32_t* cu_q,
                               const int32_t* kv_lens, void* out, int64_t B, int64_t nh, int64_t nkv, int64_t D,
                               int64_t bs, float scale, int64_t window, int threads) {
  using pagemill::bf16;
  if (q_bf16)
    return pagemill::prefill_batch<bf16>((const bf16*)q, q_stride, (const bf16*)k_cache, (const bf16*)v_cache,
                                         block_tables, width, cu_q, kv_lens, (bf16*)out, B, nh, nkv, D, bs, scale,
                                         window, threads);
  return pagemill::prefill_batch<float>((const float*)q, q_stride, (const float*)k_cache, (const float*)v_cache,
                                        block_tables, width, cu_q, kv_lens, (float*)out, B, nh, nkv, D, bs, scale,
                                        window, threads);
}

// 1 where bf16 prompt chunks of head size D multiply on AMX tiles here (compiled in, Linux
// granted them, D 64, 128 or 256), else 0.
int pagemill_prefill_attention_amx(int64_t D) { return pagemill::prefill_takes_amx(D) ? 1 : 0; }

}  // extern "C"
