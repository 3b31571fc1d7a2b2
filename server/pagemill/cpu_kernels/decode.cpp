// Decode on the CPU, float32: one whole Llama decoder layer for a single
// token, and paged attention for a batch of single-token queries.
//
// Why: at batch 1 a decode step should cost one stream over the weights
// (~17 ms for the default model at ~32 GB/s), but each layer also ran ~25
// small torch ops (norms, rotary, KV gather, SDPA, SiLU, adds) at several
// microseconds of dispatch each: ~12 ms per step, 40% of it. Here the layer
// is one call and one OpenMP region, the linears stream their weights with
// pagemill::dot, and attention reads the paged cache in place. At larger
// batches the linears stay in oneDNN (compute-bound GEMM) and only
// attention comes here: the torch path copied every sequence's blocks out of
// the pool once per layer (index_select) before SDPA; this reads them where
// they are.
//
// The arithmetic follows the torch path (models/layers.py): RMSNorm as
// w * (x * rsqrt(mean(x^2) + eps)), rotary in HF's rotate_half layout with
// the caller's cos/sin row, softmax in float32. Results agree to rounding.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "vec.h"

namespace {

using pagemill::attend_group;
using pagemill::dot;
using pagemill::PagedKV;

void rms_norm(const float* x, const float* w, float eps, int64_t H, float* out) {
  float ss = 0.f;
  for (int64_t h = 0; h < H; ++h) ss += x[h] * x[h];
  const float r = 1.f / sqrtf(ss / (float)H + eps);
  for (int64_t h = 0; h < H; ++h) out[h] = w[h] * (x[h] * r);
}

// x [heads, D] in place: x * cos + rotate_half(x) * sin.
void rotary(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* r = x + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = r[i], b = r[i + half];
      r[i] = a * cos[i] - b * sin[i];
      r[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// Indices into the layer's pointer table (models/fused_decode.py builds it).
enum Ptr { kInNorm, kQkvW, kQkvB, kOW, kPostNorm, kGateUpW, kGateUpB, kDownW, kDownB, kNumPtrs };
// Indices into the dims table.
enum Dim { kHidden, kHeads, kKvHeads, kHeadDim, kInter, kBlockSize, kNumDims };

}  // namespace

extern "C" {

int pagemill_decode_layer_ptrs() { return kNumPtrs; }
int pagemill_decode_layer_dims() { return kNumDims; }

// One decoder layer for one token. x [H]: the residual stream, updated in
// place. ptrs: float pointers as int64 (bias entries may be 0). The token's
// k/v are written at flat `slot` of the caches before attention reads the
// first `len` rows of the sequence (len includes this token).
int pagemill_decode_layer(float* x, const int64_t* ptrs, const int64_t* dims, float eps, float scale,
                          const float* cos, const float* sin, float* k_cache, float* v_cache,
                          const int32_t* block_table, int64_t len, int64_t slot, int threads) {
  auto p = [ptrs](Ptr i) { return reinterpret_cast<const float*>(ptrs[i]); };
  const int64_t H = dims[kHidden], nh = dims[kHeads], nkv = dims[kKvHeads], D = dims[kHeadDim];
  const int64_t I = dims[kInter], bs = dims[kBlockSize];
  if (nkv <= 0 || nh % nkv != 0 || len <= 0) return 1;
  const int64_t group = nh / nkv, nq = nh * D, nk = nkv * D, nqkv = nq + 2 * nk;
  const float *in_norm = p(kInNorm), *qkv_w = p(kQkvW), *qkv_b = p(kQkvB), *o_w = p(kOW);
  const float *post_norm = p(kPostNorm), *gu_w = p(kGateUpW), *gu_b = p(kGateUpB);
  const float *down_w = p(kDownW), *down_b = p(kDownB);

  // Scratch shared by the threads of the region below; kept between calls.
  static thread_local std::vector<float> buf;
  buf.resize(H + nqkv + nq + 2 * I + nh * len);
  float *xn = buf.data(), *qkv = xn + H, *attn = qkv + nqkv, *gu = attn + nq, *scores = gu + 2 * I;
  const PagedKV kv{k_cache, v_cache, block_table, bs, nkv, D};

#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    rms_norm(x, in_norm, eps, H, xn);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < nqkv; ++n) qkv[n] = dot(qkv_w + n * H, xn, H) + (qkv_b ? qkv_b[n] : 0.f);
#pragma omp single
    {
      rotary(qkv, nh + nkv, D, cos, sin);  // q and k heads are adjacent
      memcpy(k_cache + slot * nk, qkv + nq, nk * sizeof(float));
      memcpy(v_cache + slot * nk, qkv + nq + nk, nk * sizeof(float));
    }
#pragma omp for schedule(static)
    for (int64_t j = 0; j < nkv; ++j)
      attend_group(qkv + j * group * D, D, group, kv, j, len, scale, scores + j * group * len, attn + j * group * D, D);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < H; ++n) x[n] += dot(o_w + n * nq, attn, nq);
#pragma omp single
    rms_norm(x, post_norm, eps, H, xn);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < 2 * I; ++n) gu[n] = dot(gu_w + n * H, xn, H) + (gu_b ? gu_b[n] : 0.f);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < I; ++i) gu[i] = gu[i] / (1.f + expf(-gu[i])) * gu[I + i];  // silu(gate) * up
#pragma omp for schedule(static)
    for (int64_t n = 0; n < H; ++n) x[n] += dot(down_w + n * I, gu, I) + (down_b ? down_b[n] : 0.f);
  }
  return 0;
}

// Attention of B single-token queries against their paged caches.
// q: token b's heads at q + b * q_stride (heads contiguous, D apart);
// out [B, nh, D]; block_tables [B, width] int32; context_lens [B] int32.
int pagemill_paged_attention(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                             const int32_t* block_tables, int64_t width, const int32_t* context_lens, float* out,
                             int64_t B, int64_t nh, int64_t nkv, int64_t D, int64_t bs, float scale, int threads) {
  if (nkv <= 0 || nh % nkv != 0) return 1;
  const int64_t group = nh / nkv;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < nkv; ++j) {
        const int64_t len = context_lens[b];
        float* o = out + (b * nh + j * group) * D;
        if (len <= 0) {
          memset(o, 0, group * D * sizeof(float));
          continue;
        }
        scores.resize(group * len);
        const PagedKV kv{k_cache, v_cache, block_tables + b * width, bs, nkv, D};
        attend_group(q + b * q_stride + j * group * D, D, group, kv, j, len, scale, scores.data(), o, D);
      }
    }
  }
  return 0;
}
}
