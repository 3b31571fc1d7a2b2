// Decode on the CPU for a model whose linears are GGUF blocks (models/gguf/linear.py): every
// decoder layer of a few single-token sequences in one call, its linears on the quant family's
// int8 dot products (quant/quant_gemm.h) over the weights QuantKernel.prepare repacked.
//
// Why: at batch 1 the module path ran ~30 torch ops and 5 kernel calls per layer (norms, q/k
// norms, rotary, KV write, attention, GELU, residual adds) around linears that take tens of
// microseconds each; the dispatch cost more than the linears' weight streams. Here a layer is
// one OpenMP region with a barrier at the end of each linear and of attention.
//
// The layer covers the Llama family's shape and Gemma's (models/gemma.py), chosen by flags:
//   Llama:   x += o(attn(norm_in(x)));                 x += down(silu(gate) * up)(norm_pre_ffn(x))
//   Gemma:   x += norm_post_attn(o(attn(norm_in(x)))); x += norm_post_ffn(down(gelu(gate) * up)(norm_pre_ffn(x)))
// with, where the table has them, q/k norms per head before rotary (Gemma 3, Qwen3) and, for
// Gemma's windowed layers, their own rotary table. RMSNorm scales by w (Llama) or 1 + w (Gemma),
// in float32. Each linear is up to 3 parts of its own ggml type (a Q4_K_M file's q|k|v and
// gate|up may differ), with an optional float32 bias per part.
//
// Arithmetic: the activations are quantized as quant.cpp's linear quantizes them (ggml's
// Q8_0/Q8_K, quantize_rows.h) and the products are gemm_range's, so each linear's integer sums
// are the module path's; everything between the linears is float32 (the residual stream
// included), the norms and attention as decode.cpp computes them.
//
// Threads: each linear's output columns are split evenly in runs of 16 (a tile's two groups);
// gate|up is split in the intermediate dimension so each thread holds both halves of its
// columns and applies the activation without a barrier. Each thread quantizes a linear's input
// itself (B x K bytes, microseconds) rather than waiting on a shared copy, and keeps its own
// copy of the residual stream, updated by the same float operations on every thread, so the
// residual adds need no barrier either.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "attention/paged_attention.h"
#include "common/each_layer.h"
#include "common/vec.h"
#include "quant/quant_gemm.h"

namespace {

using namespace pagemill::quant;
using pagemill::attend_group;
using pagemill::bf16;
using pagemill::first_key;
using pagemill::from_float;
using pagemill::PagedKV;
using pagemill::to_float;

constexpr int64_t kMaxRows = 256;
// The pointer table (models/fused_decode.py GGUFFusedDecoder builds it): six norms (0: absent),
// then per linear kParts parts of kPartEntries: ggml type, prepared bytes, out features, the
// packed tail group of the last N % 8 rows (0: none), float32 bias (0: none). A part with no
// bytes ends the linear's list.
enum Norm { kInNorm, kPostAttnNorm, kPreFfnNorm, kPostFfnNorm, kQNorm, kKNorm, kNumNorms };
enum Lin { kQkv, kO, kGateUp, kDown, kNumLins };
constexpr int kParts = 3, kPartEntries = 5, kLinEntries = kParts * kPartEntries;
constexpr int kTablePtrs = kNumNorms + kNumLins * kLinEntries;
enum Dim { kHidden, kHeads, kKvHeads, kHeadDim, kInter, kBlockSize, kNumDims };
enum Flag { kGemmaNorms = 1, kGelu = 2, kLocalRope = 4 };
constexpr int64_t kSpan = kTileGroups * kGroup;  // output columns a tile takes

struct Linear {
  Weight part[kParts];
  const float* bias[kParts];
  int parts = 0;
  int64_t N = 0;  // all parts' outputs
};

// Linear l of a table; false where a part is not a quantized type this build multiplies.
bool read_linear(const int64_t* ptrs, int l, int64_t K, Linear& out) {
  const int64_t* e = ptrs + kNumNorms + l * kLinEntries;
  out = Linear{};
  for (int p = 0; p < kParts && e[p * kPartEntries + 1]; ++p) {
    const int64_t* q = e + p * kPartEntries;
    Weight& w = out.part[p];
    w.type = (int)q[0];
    w.data = (const uint8_t*)q[1];
    w.N = q[2];
    w.K = K;
    w.tail = (const uint8_t*)q[3];
    if (!supported(w.type) || is_float(w.type) || w.N <= 0 || row_bytes(w.type, K) <= 0) return false;
    if (w.N % kGroup && !w.tail) return false;
    out.bias[p] = (const float*)q[4];
    out.N += w.N;
    out.parts = p + 1;
  }
  return out.parts > 0;
}

// One thread's int8 copies of a linear's input: quantized once per block size the parts ask for.
struct ThreadActs {
  pagemill::line_vector<uint8_t> buf[2];
  Acts a[2];
  const float* from[2] = {nullptr, nullptr};
  void reset() { from[0] = from[1] = nullptr; }
  const Acts& get(int blk, const float* x, int64_t B, int64_t K) {
    const int i = blk == kQK;
    if (from[i] != x || a[i].K != K) {
      const size_t n = (size_t)acts_bytes(B, K, blk);
      if (buf[i].size() < n) buf[i].resize(n);
      a[i] = acts_in(buf[i].data(), B, K, blk);
      for (int64_t m = 0; m < B; ++m) quantize_row(x, false, m, a[i], nullptr);
      from[i] = x;
    }
    return a[i];
  }
};

// Columns [c0, c1) of L's concatenated output for the B rows x (K each): y[m * ld + c] (+)= .
void columns(const Linear& L, ThreadActs& acts, const float* x, int64_t B, int64_t K, int64_t c0, int64_t c1,
             float* y, int64_t ld, bool add) {  // fmt: skip
  int64_t first = 0;
  for (int p = 0; p < L.parts && first < c1; first += L.part[p].N, ++p) {
    const Weight& w = L.part[p];
    const int64_t lo = c0 > first ? c0 - first : 0, hi = c1 - first < w.N ? c1 - first : w.N;
    if (lo >= hi) continue;
    Out o;
    o.y = y + first;
    o.ld = ld;
    o.add = add;
    o.bias = L.bias[p];
    gemm_range(w, acts.get(acts_block(w.type), x, B, K), B, lo, hi, o);
  }
}

// This thread's share of [0, n): runs of kSpan, split evenly.
inline void share(int64_t n, int t, int nt, int64_t& c0, int64_t& c1) {
  const int64_t units = (n + kSpan - 1) / kSpan;
  c0 = units * t / nt * kSpan;
  c1 = units * (t + 1) / nt * kSpan;
  c1 = c1 < n ? c1 : n;
  c0 = c0 < n ? c0 : n;
}

template <typename T>
void rms_norm(const float* x, const T* w, bool gemma, float eps, int64_t H, float* out) {
  float ss = 0.f;
  for (int64_t h = 0; h < H; ++h) ss += x[h] * x[h];
  const float r = 1.f / sqrtf(ss / (float)H + eps);
  if (gemma)
    for (int64_t h = 0; h < H; ++h) out[h] = (x[h] * r) * (1.f + to_float(w[h]));
  else
    for (int64_t h = 0; h < H; ++h) out[h] = to_float(w[h]) * (x[h] * r);
}

// r [H] += o, o normed first (into scratch) where the layer has that norm: Gemma's norms after
// attention and after the MLP; a null w adds o as it is.
template <typename T>
void add_residual(float* r, const float* o, const T* w, bool gemma, float eps, int64_t H, float* scratch) {
  if (w) {
    rms_norm(o, w, gemma, eps, H, scratch);
    o = scratch;
  }
  for (int64_t h = 0; h < H; ++h) r[h] += o[h];
}

// x [D] in place: x * cos + rotate_half(x) * sin (HF's layout).
inline void rotary(float* x, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}


// One kv head's query heads (q: `group` rows of D) against its keys [first, len_end) of a float32
// pool: the arithmetic of attend_group_scalar (softmax in float32, expf), with each key and value
// row read once for all the group's heads and the products in 8-float vectors. Without AVX-512,
// attend_group takes its scalar loop, which read every row once per head and made up ~10% of a
// Gemma 3 270M decode step (head_dim 256, 4 query heads on one kv head; perf, 1 thread).
// False where it does not apply (head_dim not a multiple of 8, or no AVX2).
template <typename T>
inline bool attend_rows(const float* q, int64_t group, const PagedKV<T>& kv, int64_t kv_head, int64_t first,
                        int64_t len_end, float scale, float* scores, float* out) {  // fmt: skip
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    const int64_t D = kv.head_dim, len = len_end - first;
    if (D % 8 || len <= 0 || group > 64) return false;
    for (int64_t t = 0; t < len; ++t) {
      const float* k = kv.k + kv.row(first + t, kv_head);
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int gn = (int)(group - g0 < 4 ? group - g0 : 4);
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 kd = _mm256_loadu_ps(k + d);
          for (int g = 0; g < gn; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g0 + g) * D + d), kd, a[g]);
        }
        for (int g = 0; g < gn; ++g) {
          __m128 h = _mm_add_ps(_mm256_castps256_ps128(a[g]), _mm256_extractf128_ps(a[g], 1));
          h = _mm_add_ps(h, _mm_movehl_ps(h, h));
          h = _mm_add_ss(h, _mm_movehdup_ps(h));
          scores[(g0 + g) * len + t] = _mm_cvtss_f32(h) * scale;
        }
      }
    }
    float inv[64];
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * len;
      float m = -INFINITY;
      for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
      float sum = 0.f;
      for (int64_t t = 0; t < len; ++t) sum += (s[t] = expf(s[t] - m));
      inv[g] = 1.f / sum;
    }
    // Values: 16 output floats of up to 4 heads in registers, over all the keys.
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const int gn = (int)(group - g0 < 4 ? group - g0 : 4);
      for (int64_t d = 0; d < D; d += 16) {
        const bool two = d + 16 <= D;
        __m256 a[4][2];
        for (int g = 0; g < 4; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; ++t) {
          const float* v = kv.v + kv.row(first + t, kv_head) + d;
          const __m256 v0 = _mm256_loadu_ps(v), v1 = two ? _mm256_loadu_ps(v + 8) : _mm256_setzero_ps();
          for (int g = 0; g < gn; ++g) {
            const __m256 p = _mm256_broadcast_ss(scores + (g0 + g) * len + t);
            a[g][0] = _mm256_fmadd_ps(p, v0, a[g][0]);
            a[g][1] = _mm256_fmadd_ps(p, v1, a[g][1]);
          }
        }
        for (int g = 0; g < gn; ++g) {
          const __m256 r = _mm256_set1_ps(inv[g0 + g]);
          float* o = out + (g0 + g) * D + d;
          _mm256_storeu_ps(o, _mm256_mul_ps(a[g][0], r));
          if (two) _mm256_storeu_ps(o + 8, _mm256_mul_ps(a[g][1], r));
        }
      }
    }
    return true;
  }
#endif
  (void)q, (void)group, (void)kv, (void)kv_head, (void)first, (void)len_end, (void)scale, (void)scores, (void)out;
  return false;
}

// out[i] = act(gate[i]) * up[i] for i < n: act GELU (tanh form) or SiLU. Both as x * sigmoid(z)
// (GELU's 0.5 (1 + tanh(u)) is sigmoid(2 u)), 8 lanes at a time with a Cephes-style expf (range
// reduction and a degree-5 polynomial, ~2 ulp), the rest with libm: the scalar tanhf per element
// cost ~1 ms of a Gemma 3 270M step at batch 1 and ~40 at batch 64 (1 thread).
inline void gated(const float* gate, const float* up, int64_t n, bool gelu, float* out) {
  const float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), c1 = _mm256_set1_ps(0.693359375f);
  const __m256 c2 = _mm256_set1_ps(-2.12194440e-4f), one = _mm256_set1_ps(1.f);
  const __m256 p0 = _mm256_set1_ps(1.9875691500e-4f), p1 = _mm256_set1_ps(1.3981999507e-3f);
  const __m256 p2 = _mm256_set1_ps(8.3334519073e-3f), p3 = _mm256_set1_ps(4.1665795894e-2f);
  const __m256 p4 = _mm256_set1_ps(1.6666665459e-1f), p5 = _mm256_set1_ps(5.0000001201e-1f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    // z: the sigmoid's argument, negated (exp(-z) below)
    __m256 z = gelu ? _mm256_mul_ps(_mm256_set1_ps(-2.f * kBeta),
                                    _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kKappa), g), _mm256_mul_ps(g, g), g))
                    : _mm256_sub_ps(_mm256_setzero_ps(), g);  // fmt: skip
    z = _mm256_max_ps(_mm256_min_ps(z, hi), lo);
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(z, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, c1, z);
    r = _mm256_fnmadd_ps(fx, c2, r);
    __m256 y = _mm256_fmadd_ps(p0, r, p1);
    y = _mm256_fmadd_ps(y, r, p2);
    y = _mm256_fmadd_ps(y, r, p3);
    y = _mm256_fmadd_ps(y, r, p4);
    y = _mm256_fmadd_ps(y, r, p5);
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    const __m256 ex = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    const __m256 a = _mm256_div_ps(g, _mm256_add_ps(one, ex));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(a, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = gate[i];
    out[i] = (gelu ? 0.5f * g * (1.f + tanhf(kBeta * (g + kKappa * g * g * g))) : g / (1.f + expf(-g))) * up[i];
  }
}

template <typename T>
int gguf_layer(float* x, int64_t B, const int64_t* ptrs, const int64_t* dims, float eps, float scale, int flags,
               const float* cos, const float* sin, T* k_cache, T* v_cache, const int32_t* block_tables,
               int64_t width, const int32_t* lens, const int64_t* slots, int64_t window, int threads) {  // fmt: skip
  const int64_t H = dims[kHidden], nh = dims[kHeads], nkv = dims[kKvHeads], D = dims[kHeadDim];
  const int64_t I = dims[kInter], bs = dims[kBlockSize];
  if (B < 1 || B > kMaxRows || nkv <= 0 || nh % nkv != 0 || D % 2 || !ptrs[kInNorm] || !ptrs[kPreFfnNorm]) return 1;
  const int64_t group = nh / nkv, nq = nh * D, nk = nkv * D, nqkv = nq + 2 * nk;
  Linear qkv_l, o_l, gu_l, down_l;
  if (!read_linear(ptrs, kQkv, H, qkv_l) || qkv_l.N != nqkv || !read_linear(ptrs, kO, nq, o_l) || o_l.N != H ||
      !read_linear(ptrs, kGateUp, H, gu_l) || gu_l.N != 2 * I || !read_linear(ptrs, kDown, I, down_l) ||
      down_l.N != H)  // fmt: skip
    return 1;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (lens[b] <= 0) return 1;
    max_len = lens[b] > max_len ? lens[b] : max_len;
  }
  const bool gemma = flags & kGemmaNorms, gelu = flags & kGelu;
  const T* norm[kNumNorms];
  for (int i = 0; i < kNumNorms; ++i) norm[i] = (const T*)ptrs[i];

  static thread_local std::vector<float> buf;  // shared by the region's threads
  buf.resize(B * (nqkv + nq + I + H) + threads * group * max_len);
  float *qkv = buf.data(), *attn = qkv + B * nqkv, *act = attn + B * nq, *tmp = act + B * I;
  float* scores = tmp + B * H;

#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    static thread_local std::vector<float> own;  // this thread's residual stream and normalised rows
    static thread_local std::vector<float> gu;  // its gate|up columns
    static thread_local ThreadActs acts;
    own.resize(2 * B * H);
    float *xr = own.data(), *xn = xr + B * H;
    memcpy(xr, x, sizeof(float) * B * H);
    int64_t c0, c1;

    acts.reset();
    for (int64_t b = 0; b < B; ++b) rms_norm(xr + b * H, norm[kInNorm], gemma, eps, H, xn + b * H);
    share(nqkv, t, nt, c0, c1);
    columns(qkv_l, acts, xn, B, H, c0, c1, qkv, nqkv, false);
#pragma omp barrier
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < nkv; ++j) {
        float *k = qkv + b * nqkv + nq + j * D, *v = k + nk;
        if (norm[kKNorm]) rms_norm(k, norm[kKNorm], gemma, eps, D, k);
        rotary(k, D, cos + b * D, sin + b * D);
        T *kc = k_cache + slots[b] * nk + j * D, *vc = v_cache + slots[b] * nk + j * D;
        for (int64_t d = 0; d < D; ++d) {
          kc[d] = from_float<T>(k[d]);
          vc[d] = from_float<T>(v[d]);
        }
      }
    // (the loop's barrier: every new token's k/v is in the pool)
    // Tasks of a kv head's whole query group (each key and value row read once for them), or of
    // one query head where there are fewer groups than threads (one sequence of a model with one
    // kv head: its 4 heads shared by the team).
    const int64_t per = B * nkv >= nt ? group : 1, tasks = B * nh / per;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tasks; ++i) {
      const int64_t b = i * per / nh, h = i * per % nh;
      float* q = qkv + b * nqkv + h * D;
      for (int64_t g = 0; g < per; ++g) {
        if (norm[kQNorm]) rms_norm(q + g * D, norm[kQNorm], gemma, eps, D, q + g * D);
        rotary(q + g * D, D, cos + b * D, sin + b * D);
      }
      const PagedKV<T> kv{k_cache, v_cache, block_tables + b * width, bs, nkv, D};
      const int64_t first = first_key(lens[b], window);
      float* sc = scores + omp_get_thread_num() * group * max_len;
      float* o = attn + b * nq + h * D;
      if (!attend_rows(q, per, kv, h / group, first, lens[b], scale, sc, o))
        attend_group(q, D, per, kv, h / group, first, lens[b], scale, sc, o, D);
    }
    acts.reset();
    share(H, t, nt, c0, c1);
    columns(o_l, acts, attn, B, nq, c0, c1, tmp, H, false);
#pragma omp barrier
    for (int64_t b = 0; b < B; ++b) {
      add_residual(xr + b * H, tmp + b * H, norm[kPostAttnNorm], gemma, eps, H, xn + b * H);
      rms_norm(xr + b * H, norm[kPreFfnNorm], gemma, eps, H, xn + b * H);
    }
    // gate|up: this thread's columns [c0, c1) of both halves, then their activation.
    acts.reset();
    share(I, t, nt, c0, c1);
    if (c1 > c0) {
      const int64_t w = c1 - c0;
      gu.resize(B * 2 * w);
      // The halves land side by side in gu [B][gate w | up w]: columns() writes y[m * ld + c],
      // so each half is offset by its first column.
      columns(gu_l, acts, xn, B, H, c0, c1, gu.data() - c0, 2 * w, false);
      columns(gu_l, acts, xn, B, H, I + c0, I + c1, gu.data() + w - (I + c0), 2 * w, false);
      for (int64_t b = 0; b < B; ++b) gated(gu.data() + b * 2 * w, gu.data() + b * 2 * w + w, w, gelu, act + b * I + c0);
    }
#pragma omp barrier
    acts.reset();
    share(H, t, nt, c0, c1);
    columns(down_l, acts, act, B, I, c0, c1, tmp, H, false);
#pragma omp barrier
    for (int64_t b = 0; b < B; ++b)
      add_residual(xr + b * H, tmp + b * H, norm[kPostFfnNorm], gemma, eps, H, xn + b * H);
    if (t == 0) memcpy(x, xr, sizeof(float) * B * H);
  }
  return 0;
}

}  // namespace

extern "C" {

int pagemill_decode_gguf_ptrs() { return kTablePtrs; }
int pagemill_decode_gguf_dims() { return kNumDims; }
int pagemill_decode_gguf_max_rows() { return (int)kMaxRows; }

// The last N % 8 rows of a prepared weight as the group the kernels read (8 * row_bytes bytes
// at out); 0, or 1 on a bad type or shape.
int pagemill_quant_pack_tail(int type, const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {
  if (!supported(type) || is_float(type) || N <= 0 || row_bytes(type, K) <= 0 || N % kGroup == 0) return 1;
  Weight wt{type, w, N, K};
  pack_tail(wt, out);
  return 0;
}

// Every layer of a GGUF model in one call (each_layer.h). x [B, hidden] float32: in, the
// embedded tokens; out, the last layer's output. Norm weights and pools float32 (kv_bf16 0) or
// bfloat16 (1); cos/sin [B, head_dim] float32, cos_local/sin_local those of windowed layers
// where flags has kLocalRope.
int pagemill_decode_layers_gguf(float* x, int64_t B, int64_t layers, const int64_t* tables, const int64_t* dims,
                                float eps, float scale, int flags, const float* cos, const float* sin,
                                const float* cos_local, const float* sin_local, const int64_t* kv,
                                const int32_t* block_tables, int64_t width, const int32_t* lens, const int64_t* slots,
                                const int64_t* windows, int kv_bf16, int threads, int64_t* failed) {  // fmt: skip
  const auto run = [&](int64_t, const int64_t* ptrs, void* k, void* v, int64_t window) {
    const bool local = (flags & kLocalRope) && window > 0;
    const float *c = local ? cos_local : cos, *s = local ? sin_local : sin;
    if (kv_bf16)
      return gguf_layer<bf16>(x, B, ptrs, dims, eps, scale, flags, c, s, (bf16*)k, (bf16*)v, block_tables, width,
                              lens, slots, window, threads);  // fmt: skip
    return gguf_layer<float>(x, B, ptrs, dims, eps, scale, flags, c, s, (float*)k, (float*)v, block_tables, width,
                             lens, slots, window, threads);  // fmt: skip
  };
  return pagemill::each_layer(layers, tables, kv, windows, failed, run);
}
}
