// Decode on the CPU, float32 or bfloat16 weights and KV pool: one whole
// Llama decoder layer for a few sequences of one token each, and paged
// attention for a batch of single-token queries.
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
//
// bfloat16: weights, norms, biases and the KV pool are read as bf16 (the
// linears multiply with vdpbf16ps where the CPU has it, else widen to
// float32; bf16_rows.h); everything else in the layer, the residual stream
// included, stays float32. That is at least as accurate as torch's bf16
// modules (which round every intermediate to bf16) and adds no memory
// traffic worth counting: the layer's traffic is the weights.
//
// int8 (--quantize int8): the same layer with Int8Linears, the int8 linear's
// own arithmetic from int8_rows.h (per-row activation quantization, int32
// sums, down_proj's Hadamard rotation) over QuantizedLinear's packed weights;
// norms and pool float32 or bf16. Each thread quantizes a linear's input
// rows itself and takes a balanced range of 16-channel blocks.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "common/bf16_row_ops.h"  // silu16
#include "common/bf16_rows.h"
#include "common/each_layer.h"
#include "int8/int8_rows.h"
#include "attention/paged_attention.h"
#include "common/team_balance.h"
#include "common/vec.h"

namespace {

using pagemill::attend_group;
using pagemill::bf16;
using pagemill::Bf16Mul;
using pagemill::dot;
using pagemill::first_key;
using pagemill::from_float;
using pagemill::PagedKV;
using pagemill::to_float;

template <typename T>
void rms_norm(const float* x, const T* w, float eps, int64_t H, float* out) {
  float ss = 0.f;
  for (int64_t h = 0; h < H; ++h) ss += x[h] * x[h];
  const float r = 1.f / sqrtf(ss / (float)H + eps);
  for (int64_t h = 0; h < H; ++h) out[h] = to_float(w[h]) * (x[h] * r);
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

// out[m] = x[m] . w for M input rows x (stride K) against one weight row w:
// the weight row is loaded once per 16 floats for all M rows.
template <int M>
inline void rows_dot(const float* x, const float* w, int64_t K, float* out) {
  if (M == 1) {  // two FMA chains for one row (pagemill::dot)
    out[0] = pagemill::dot<true>(w, x, K);
    return;
  }
#if defined(__AVX512F__)
  __m512 a[M];
  for (int m = 0; m < M; ++m) a[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    pagemill::ask_ahead(w + k);
    const __mmask16 t = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    const __m512 u = _mm512_maskz_loadu_ps(t, w + k);
    for (int m = 0; m < M; ++m) a[m] = _mm512_fmadd_ps(u, _mm512_maskz_loadu_ps(t, x + m * K + k), a[m]);
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(a[m]);
#else
  for (int m = 0; m < M; ++m) out[m] = dot(w, x + m * K, K);
#endif
}

// Float activations as the linears over T weights read them: as they are
// for float32; for bf16, each thread's own copy in bf16_rows.h's layout
// (no barrier needed: x is complete when a linear starts).
struct Rows {
  const float* x;
  void* scratch;  // this thread's, pagemill::prepared_bytes(M, K) or more
  Bf16Mul mul;
};

template <int M>
inline void weight_dot(const Rows& x, const float* w, int64_t K, float* r) {
  rows_dot<M>(x.x, w, K, r);
}
template <int M>
inline void weight_dot(const pagemill::Bf16Rows& x, const bf16* w, int64_t K, float* r) {
  pagemill::rows_dot<M>(x, w, K, r);
}

// y[m * N + n] (+)= x[m] . w[n] + bias[n] for m < M; the calling thread's share
// of n (balance's, else an even one; call it inside a parallel region), then the
// barrier that ends the linear.
template <int M, typename T>
void linear_share(const Rows& x, const T* w, const T* bias, float* y, int64_t N, int64_t K, bool add,
                  pagemill::balance::TeamBalance* balance) {
  const int t = omp_get_thread_num(), nt = omp_get_num_threads();
  {
    const pagemill::balance::Busy busy(balance, t, nt);
    const auto xr = [&] {
      if constexpr (std::is_same_v<T, float>)
        return x;
      else
        return pagemill::prepare(x.x, M, K, x.mul, x.scratch);
    }();
    const int64_t n1 = pagemill::balance::bound(balance, N, t + 1, nt);
    for (int64_t n = pagemill::balance::bound(balance, N, t, nt); n < n1; ++n) {
      float r[M];
      weight_dot<M>(xr, w + n * K, K, r);
      const float b = bias ? to_float(bias[n]) : 0.f;
      for (int m = 0; m < M; ++m) y[m * N + n] = (add ? y[m * N + n] : 0.f) + (r[m] + b);
    }
  }
#pragma omp barrier
}

constexpr int kMaxLayerRows = 8;
// int8 linears are int8_rows.h's share(), on AMX tiles from 8 rows, so the int8 layer takes
// batches up to this (its scratch grows with the rows; models/fused_decode.py says where the
// shard uses it).
constexpr int kMaxInt8Rows = 256;

template <typename T>
void linear(int64_t M, const Rows& x, const T* w, const T* bias, float* y, int64_t N, int64_t K, bool add,
            pagemill::balance::TeamBalance* bal) {
  switch (M) {
    case 1: linear_share<1>(x, w, bias, y, N, K, add, bal); break;
    case 2: linear_share<2>(x, w, bias, y, N, K, add, bal); break;
    case 3: linear_share<3>(x, w, bias, y, N, K, add, bal); break;
    case 4: linear_share<4>(x, w, bias, y, N, K, add, bal); break;
    case 5: linear_share<5>(x, w, bias, y, N, K, add, bal); break;
    case 6: linear_share<6>(x, w, bias, y, N, K, add, bal); break;
    case 7: linear_share<7>(x, w, bias, y, N, K, add, bal); break;
    case 8: linear_share<8>(x, w, bias, y, N, K, add, bal); break;
  }
}

// out[j] = silu(gate[j]) * up[j], float32 rows.
inline void silu_mul_f32(const float* gate, const float* up, int64_t n, float* out) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(out + j, _mm512_mul_ps(pagemill::rows::silu16(_mm512_loadu_ps(gate + j)), _mm512_loadu_ps(up + j)));
#endif
  for (; j < n; ++j) out[j] = gate[j] / (1.f + expf(-gate[j])) * up[j];
}

// Indices into the layer's pointer table (models/fused_decode.py builds it).
enum Ptr { kInNorm, kQkvW, kQkvB, kOW, kPostNorm, kGateUpW, kGateUpB, kDownW, kDownB, kNumPtrs };
// Indices into the dims table.
enum Dim { kHidden, kHeads, kKvHeads, kHeadDim, kInter, kBlockSize, kNumDims };
// A layer's four linears, in the order the int8 table lists them.
enum Lin { kQkv, kO, kGateUp, kDown };

// The linears of a layer with T weights (ptrs: decode.cpp's Ptr table).
template <typename T>
struct DenseLinears {
  static constexpr int64_t kMaxRows = kMaxLayerRows;
  const int64_t* ptrs;
  Bf16Mul mul;
  struct Shared {};
  Shared prepare(int64_t, int64_t) const { return {}; }
  // One thread's view inside the layer's parallel region: y (+)= in W^T + b
  // for its share of the outputs (balance's), ending on a barrier.
  struct Thread {
    const DenseLinears& d;
    void* prep;
    pagemill::balance::TeamBalance* balance;
    void operator()(Lin l, int64_t B, const float* in, float* y, int64_t N, int64_t K, bool add) const {
      static constexpr Ptr w[] = {kQkvW, kOW, kGateUpW, kDownW}, b[] = {kQkvB, kNumPtrs, kGateUpB, kDownB};
      const T* bias = b[l] == kNumPtrs ? nullptr : reinterpret_cast<const T*>(d.ptrs[b[l]]);
      linear(B, Rows{in, prep, d.mul}, reinterpret_cast<const T*>(d.ptrs[w[l]]), bias, y, N, K, add, balance);
    }
  };
  Thread thread(int64_t B, int64_t widest, pagemill::balance::TeamBalance* balance, Shared) const {
    static thread_local std::vector<float> prep;  // this thread's bf16_rows.h copy of a linear's input
    if (!std::is_same_v<T, float>) prep.resize(pagemill::prepared_bytes(B, widest) / sizeof(float));
    return Thread{*this, prep.data(), balance};
  }
};

// The linears of an int8 model (int8_rows.h's arithmetic, QuantizedLinear's
// packed tensors). Table: kInt8Norms norm pointers, then per Lin kInt8Entry
// entries: packed weight, w_scale, w_corr, bias (float32 or 0), rotate.
constexpr int kInt8Norms = 2, kInt8Entry = 5, kInt8Ptrs = kInt8Norms + 4 * kInt8Entry;
struct Int8Linears {
  static constexpr int64_t kMaxRows = kMaxInt8Rows;
  // Rows from which the team quantizes a linear's input once, a share of the rows each, into
  // buffers they all read (Shared), ending on a barrier. Below, each thread quantizes every
  // row itself, so no thread waits for another before its share of the product; with many
  // rows that duplicate work (the down projection's rows are rotated first) grows with the
  // batch while each thread's share of the product does not.
  static constexpr int64_t kSharedRows = 16;
  const int64_t* ptrs;
  struct Shared {
    uint8_t* xu = nullptr;
    float* x_scale = nullptr;
  };
  // Before the layer's region (one caller thread: the shard's model runner).
  Shared prepare(int64_t B, int64_t widest) const {
    if (B < kSharedRows) return {};
    static thread_local pagemill::line_vector<uint8_t> xu;
    static thread_local std::vector<float> scale;
    xu.resize(B * ((widest + 3) / 4 * 4));
    scale.resize(B);
    return {xu.data(), scale.data()};
  }
  struct Thread {
    const Int8Linears& d;
    uint8_t* xu;
    float* x_scale;
    float* tmp;
    Shared shared;
    pagemill::balance::TeamBalance* balance;
    void operator()(Lin l, int64_t B, const float* in, float* y, int64_t N, int64_t K, bool add) const {
      const int64_t* e = d.ptrs + kInt8Norms + kInt8Entry * l;
      const int64_t Kp = (K + 3) / 4 * 4;
      uint8_t* q = xu;
      float* s = x_scale;
      if (shared.xu) {
        q = shared.xu, s = shared.x_scale;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < B; ++m)
          s[m] = pagemill::int8::quantize_row(in + m * K, false, K, Kp, e[4], q + m * Kp, tmp);
      } else {
        for (int64_t m = 0; m < B; ++m)
          s[m] = pagemill::int8::quantize_row(in + m * K, false, K, Kp, e[4], q + m * Kp, tmp);
      }
      pagemill::int8::Args a{q, s, (const int8_t*)e[0], (const float*)e[1], (const int32_t*)e[2],
                             (const float*)e[3], y, false, B, N, Kp, add, balance};
      pagemill::int8::share(a, omp_get_thread_num(), omp_get_num_threads());
#pragma omp barrier
    }
  };
  Thread thread(int64_t B, int64_t widest, pagemill::balance::TeamBalance* balance, Shared shared) const {
    static thread_local std::vector<uint8_t> xu;
    static thread_local std::vector<float> f;
    if (!shared.xu) xu.resize(B * ((widest + 3) / 4 * 4));
    f.resize(B + widest);
    return Thread{*this, xu.data(), f.data(), f.data() + B, shared, balance};
  }
};

// One decoder layer for B sequences of one new token each (B <= L::kMaxRows).
// x [B, H]: the float32 residual stream, updated in place. Norm weights and the
// KV pool hold T; `lin` the linears (DenseLinears, Int8Linears). cos/sin [B, D]
// float32. Token b's k/v are written at flat slot slots[b] before attention
// reads the first lens[b] rows of its sequence (block_tables [B, width]; lens
// include the new token), or only the last `window` of them (a sliding-window
// layer; 0: all).
template <typename T, typename L>
int decode_layer(float* x, int64_t B, const T* in_norm, const T* post_norm, const L& lin, const int64_t* dims,
                 float eps, float scale, const float* cos, const float* sin, T* k_cache, T* v_cache,
                 const int32_t* block_tables, int64_t width, const int32_t* lens, const int64_t* slots, int64_t window,
                 int threads) {
  const int64_t H = dims[kHidden], nh = dims[kHeads], nkv = dims[kKvHeads], D = dims[kHeadDim];
  const int64_t I = dims[kInter], bs = dims[kBlockSize];
  if (B < 1 || B > L::kMaxRows || nkv <= 0 || nh % nkv != 0) return 1;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (lens[b] <= 0) return 1;
    max_len = lens[b] > max_len ? lens[b] : max_len;
  }
  const int64_t group = nh / nkv, nq = nh * D, nk = nkv * D, nqkv = nq + 2 * nk;

  // Attention by spans of all heads where the shape allows (paged_attention_spans.h):
  // the per-kv-head loop gave the team B x kv_heads tasks, 3 for one sequence of the
  // default model (2 and 1 on two threads), and read each block's rows a head at a time.
#if defined(__AVX512F__)
  const bool by_spans = pagemill::spans_apply<T>(D, group);
  const pagemill::SpanPlan plan = pagemill::plan_spans(lens, B, nh, D, threads);
  const int64_t part_floats = by_spans ? plan.parts_floats() : 0;
#else
  const bool by_spans = false;
  const int64_t part_floats = 0;
#endif
  // Scratch shared by the threads of the region below; kept between calls.
  static thread_local std::vector<float> buf;
  // Without spans, attention's scores: one (sequence, kv head) task at a time per thread, so
  // a scratch per thread (the int8 layer's batches reach 256 sequences).
  const int64_t score_floats = by_spans ? 0 : threads * group * max_len;
  buf.resize(B * (nqkv + nq + 2 * I + I) + score_floats + part_floats);
  float *qkv = buf.data(), *attn = qkv + B * nqkv, *gu = attn + B * nq, *act = gu + B * 2 * I;
  float *scores = act + B * I, *parts = scores + score_floats;
  const int64_t widest = H > nq ? (H > I ? H : I) : (nq > I ? nq : I);

  // Few barriers per layer (the ends of the linears and of attention; by spans,
  // one more after the KV write and one after a merge): each thread normalises x
  // into its own buffer instead of one thread doing it behind a barrier, and
  // rotary + KV write run per kv head (with attention where not by spans).
  // The linears' shares of the team, adapted layer by layer (team_balance.h says why).
  pagemill::balance::TeamBalance* const balance = pagemill::balance::begin_team(threads);
  const auto shared = lin.prepare(B, widest);
#pragma omp parallel num_threads(threads)
  {
    static thread_local std::vector<float> own;  // this thread's normalised x [B, H]
    own.resize(B * H);
    float* xn = own.data();
    const auto linear = lin.thread(B, widest, balance, shared);
    for (int64_t b = 0; b < B; ++b) rms_norm(x + b * H, in_norm, eps, H, xn + b * H);
    linear(kQkv, B, xn, qkv, nqkv, H, false);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < nkv; ++j) {
        float* t = qkv + b * nqkv;
        float *q = t + j * group * D, *k = t + nq + j * D, *v = t + nq + nk + j * D;
        rotary(q, group, D, cos + b * D, sin + b * D);
        rotary(k, 1, D, cos + b * D, sin + b * D);
        T *kc = k_cache + slots[b] * nk + j * D, *vc = v_cache + slots[b] * nk + j * D;
        for (int64_t d = 0; d < D; ++d) {
          kc[d] = from_float<T>(k[d]);
          vc[d] = from_float<T>(v[d]);
        }
        if (by_spans) continue;
        const PagedKV<T> kv{k_cache, v_cache, block_tables + b * width, bs, nkv, D};
        attend_group(q, D, group, kv, j, first_key(lens[b], window), lens[b], scale,
                     scores + omp_get_thread_num() * group * max_len,
                     attn + b * nq + j * group * D, D);
      }
    }
#if defined(__AVX512F__)
    // After the loop's barrier: every new token's k/v is in the pool.
    if (by_spans)
      pagemill::attend_spans_in_region(qkv, nqkv, k_cache, v_cache, block_tables, width, lens, attn, B, nh, nkv, D,
                                       bs, scale, window, plan, parts);
#endif
    linear(kO, B, attn, x, H, nq, true);  // residual add
    for (int64_t b = 0; b < B; ++b) rms_norm(x + b * H, post_norm, eps, H, xn + b * H);
    linear(kGateUp, B, xn, gu, 2 * I, H, false);
    if constexpr (L::kMaxRows <= kMaxLayerRows) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < B * I; ++i) {
        const float g = gu[(i / I) * 2 * I + i % I], u = gu[(i / I) * 2 * I + I + i % I];
        act[i] = g / (1.f + expf(-g)) * u;  // silu(gate) * up
      }
    } else {
      // The int8 layer's batches: 16 lanes at a time (expf is one call per element, and the
      // int8 layer takes up to 256 rows), at every batch size, so a row's result does not
      // depend on its batch.
#pragma omp for schedule(static)
      for (int64_t b = 0; b < B; ++b) silu_mul_f32(gu + b * 2 * I, gu + b * 2 * I + I, I, act + b * I);
    }
    linear(kDown, B, act, x, H, I, true);  // residual add
  }
  pagemill::balance::end_team(balance);
  return 0;
}

// The Ptr table's layer with T weights.
template <typename T>
int dense_layer(float* x, int64_t B, const int64_t* ptrs, const int64_t* dims, float eps, float scale,
                const float* cos, const float* sin, T* k_cache, T* v_cache, const int32_t* block_tables,
                int64_t width, const int32_t* lens, const int64_t* slots, int64_t window, int threads, Bf16Mul mul) {
  return decode_layer(x, B, (const T*)ptrs[kInNorm], (const T*)ptrs[kPostNorm], DenseLinears<T>{ptrs, mul}, dims,
                      eps, scale, cos, sin, k_cache, v_cache, block_tables, width, lens, slots, window, threads);
}

}  // namespace

extern "C" {

int pagemill_decode_layer_ptrs() { return kNumPtrs; }
int pagemill_decode_layer_dims() { return kNumDims; }
int pagemill_decode_layer_max_rows() { return kMaxLayerRows; }

// Every layer of the model in one call (each_layer.h: the tables, pools and windows, the code
// and index of a failing layer). x [B, hidden] float32: in, the embedded tokens; out, the last
// layer's output.

// decode_layer<float>: the tables and caches float32.
int pagemill_decode_layers(float* x, int64_t B, int64_t layers, const int64_t* tables, const int64_t* dims, float eps,
                           float scale, const float* cos, const float* sin, const int64_t* kv,
                           const int32_t* block_tables, int64_t width, const int32_t* lens, const int64_t* slots,
                           const int64_t* windows, int threads, int64_t* failed) {
  const auto run = [&](int64_t, const int64_t* ptrs, void* k, void* v, int64_t window) {
    return dense_layer<float>(x, B, ptrs, dims, eps, scale, cos, sin, (float*)k, (float*)v, block_tables, width, lens,
                              slots, window, threads, Bf16Mul::kWiden);
  };
  return pagemill::each_layer(layers, tables, kv, windows, failed, run);
}

// decode_layer<bf16>: the tables and caches bfloat16, x and cos/sin float32; mul: -1 for the
// measured default, else a pagemill::Bf16Mul.
int pagemill_decode_layers_bf16(float* x, int64_t B, int64_t layers, const int64_t* tables, const int64_t* dims,
                                float eps, float scale, const float* cos, const float* sin, const int64_t* kv,
                                const int32_t* block_tables, int64_t width, const int32_t* lens,
                                const int64_t* slots, const int64_t* windows, int threads, int mul,
                                int64_t* failed) {
  const Bf16Mul m = pagemill::usable(mul < 0 ? pagemill::choose_mul(B) : (Bf16Mul)mul);
  const auto run = [&](int64_t, const int64_t* ptrs, void* k, void* v, int64_t window) {
    return dense_layer<bf16>(x, B, ptrs, dims, eps, scale, cos, sin, (bf16*)k, (bf16*)v, block_tables, width, lens,
                             slots, window, threads, m);
  };
  return pagemill::each_layer(layers, tables, kv, windows, failed, run);
}

int pagemill_decode_layer_int8_ptrs() { return kInt8Ptrs; }
int pagemill_decode_layer_int8_max_rows() { return kMaxInt8Rows; }

// The layers of an int8 model (Int8Linears' tables): norms and caches float32 (kv_bf16 0) or
// bfloat16 (1), x and cos/sin float32. Each linear's rotate is 0 or a power of two dividing
// its K (QuantizedLinear checks it).
int pagemill_decode_layers_int8(float* x, int64_t B, int64_t layers, const int64_t* tables, const int64_t* dims,
                                float eps, float scale, const float* cos, const float* sin, const int64_t* kv,
                                const int32_t* block_tables, int64_t width, const int32_t* lens,
                                const int64_t* slots, const int64_t* windows, int threads, int kv_bf16,
                                int64_t* failed) {
  const auto run = [&](int64_t, const int64_t* ptrs, void* k, void* v, int64_t window) {
    const Int8Linears lin{ptrs};
    if (kv_bf16)
      return decode_layer(x, B, (const bf16*)ptrs[0], (const bf16*)ptrs[1], lin, dims, eps, scale, cos, sin, (bf16*)k,
                          (bf16*)v, block_tables, width, lens, slots, window, threads);
    return decode_layer(x, B, (const float*)ptrs[0], (const float*)ptrs[1], lin, dims, eps, scale, cos, sin,
                        (float*)k, (float*)v, block_tables, width, lens, slots, window, threads);
  };
  return pagemill::each_layer(layers, tables, kv, windows, failed, run);
}

int pagemill_paged_attention(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                             const int32_t* block_tables, int64_t width, const int32_t* context_lens, float* out,
                             int64_t B, int64_t nh, int64_t nkv, int64_t D, int64_t bs, float scale, int64_t window,
                             int threads) {
  return pagemill::attend_batch<float>(q, q_stride, k_cache, v_cache, block_tables, width, context_lens, out, B, nh, nkv, D,
                                bs, scale, window, threads);
}

// An fp8 cache (fp8: 0 e4m3fn, 1 e5m2) under float32 (q_bf16 0) or bf16 (1) queries
// and outputs, its entries widened exactly (scale 1, attention/kv_dtype.py).
int pagemill_paged_attention_fp8(const void* q, int q_bf16, int fp8, int64_t q_stride, const void* k_cache,
                                 const void* v_cache, const int32_t* block_tables, int64_t width,
                                 const int32_t* context_lens, void* out, int64_t B, int64_t nh, int64_t nkv,
                                 int64_t D, int64_t bs, float scale, int64_t window, int threads) {
  using pagemill::fp8e4m3;
  using pagemill::fp8e5m2;
#define PAGEMILL_FP8_CALL(T, C)                                                                              \
  return pagemill::attend_batch<T, C>((const T*)q, q_stride, (const C*)k_cache, (const C*)v_cache, block_tables, width, \
                               context_lens, (T*)out, B, nh, nkv, D, bs, scale, window, threads)
  if (q_bf16 && fp8 == 0) PAGEMILL_FP8_CALL(bf16, fp8e4m3);
  if (q_bf16) PAGEMILL_FP8_CALL(bf16, fp8e5m2);
  if (fp8 == 0) PAGEMILL_FP8_CALL(float, fp8e4m3);
  PAGEMILL_FP8_CALL(float, fp8e5m2);
#undef PAGEMILL_FP8_CALL
}

int pagemill_paged_attention_bf16(const bf16* q, int64_t q_stride, const bf16* k_cache, const bf16* v_cache,
                                  const int32_t* block_tables, int64_t width, const int32_t* context_lens, bf16* out,
                                  int64_t B, int64_t nh, int64_t nkv, int64_t D, int64_t bs, float scale,
                                  int64_t window, int threads) {
  return pagemill::attend_batch<bf16>(q, q_stride, k_cache, v_cache, block_tables, width, context_lens, out, B, nh, nkv, D,
                               bs, scale, window, threads);
}
}
