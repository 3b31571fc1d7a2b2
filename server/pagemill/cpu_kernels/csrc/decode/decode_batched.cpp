// One bfloat16 Llama decoder layer for a batch of rows in one call: single-token
// sequences (decode, 5 to a few hundred), or the rows of a step with prompt
// chunks (prefill, or a mixed step: prompt chunks beside one-token rows). The
// module path's arithmetic with its linears in gemm_bf16.h's tiles, without
// its ~10 calls per layer.
//
// Why: in a 64-sequence decode step of the default model (~67 ms) the norms,
// rotary, KV write, SiLU and the Python and dispatch around each of them took
// ~11 ms (docs/cpu.md): each is a ctypes or aten call of 20-60 us that wakes
// the OpenMP team for a few microseconds of work. decode.cpp's fused layer
// already removes them for 1-4 sequences, but with row-by-row dot products
// that lose to the GEMM's tiles from ~5 rows. A mixed step paid the same:
// 64 decode rows beside a 16-token prompt chunk took 54 ms on the module path
// against 39 for the 64 rows alone, and under a steady stream of arrivals
// most steps are mixed. Here the layer is one parallel region (attention's
// span tasks shared by the team between the stages; two regions around
// attend_batch's own for shapes spans do not take, and around the prompt
// chunks' attention, prefill_attention.h), each stage work-shared and ended
// by a barrier. The I % 16 == 0 of the SwiGLU epilogue is checked here.
//
// Bit for bit the module path (models/llama.py with packed_linear's GEMM and
// the row kernels): the same bf16 roundings at the same places (bf16 residual
// stream, bf16 intermediates), the same functions (bf16_row_ops.h, gemm_bf16.h's
// tiles, attend_batch, prefill_batch), whose results do not depend on how
// threads split the work. tests/test_batched_decode.py compares the two
// exactly.
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "common/bf16_row_ops.h"
#include "common/each_layer.h"
#include "gemm/gemm_bf16.h"
#include "attention/paged_attention.h"
#include "attention/prefill_attention.h"
#include "common/vec.h"

namespace {

using pagemill::bf16;

// Indices into the layer's pointer table (models/batched_decode.py builds it): norm weights,
// gemm_bf16's packed weights (pack_bf16; gate_up: pack_swiglu, its bias interleaved the same
// way) and biases (or 0), all bf16.
enum Ptr { kInNorm, kQkvW, kQkvB, kOW, kPostNorm, kGateUpW, kGateUpB, kDownW, kDownB, kNumPtrs };
// Indices into the dims table.
enum Dim { kHidden, kHeads, kKvHeads, kHeadDim, kInter, kBlockSize, kNumDims };

// y[B, N] = x[B, K] W^T + b: this thread's share of the blocks, then the barrier that ends it.
// swiglu: w is the interleaved gate_up (gemm_bf16.h), y [B, N/2] = silu(gate) * up.
inline void linear(const bf16* x, int64_t w, int64_t bias, bf16* y, int64_t B, int64_t N, int64_t K,
                   pagemill::balance::TeamBalance* balance, bool swiglu = false) {
  pagemill::gemm::Args a{x, K, (const bf16*)w, (const bf16*)bias, y, swiglu ? N / 2 : N, B, N, K};
  a.swiglu = swiglu;
  a.balance = balance;
  pagemill::gemm::share(a, omp_get_thread_num(), omp_get_num_threads());
#pragma omp barrier
}

// The layer (the extern functions below say what each argument is); cu_q null: B one-token
// sequences (decode, seqs == B), else the rows of a step with prompt chunks.
int layer(bf16* x, bf16* residual, int first, int64_t B, const int64_t* ptrs, const int64_t* dims, float eps,
          float scale, const bf16* cos, const bf16* sin, bf16* k_cache, bf16* v_cache, const int32_t* block_tables,
          int64_t width, const int32_t* lens, const int32_t* cu_q, int64_t seqs, const int64_t* slots,
          int64_t num_slots, int64_t window, int threads) {
  const int64_t H = dims[kHidden], nh = dims[kHeads], nkv = dims[kKvHeads], D = dims[kHeadDim];
  const int64_t I = dims[kInter], bs = dims[kBlockSize];
  if (!pagemill::gemm::kDpbf16) return 1;  // the SwiGLU epilogue is AVX512-BF16's
  if (B < 1 || nkv <= 0 || nh % nkv != 0 || D % 2 || H % 2 || I % 16 || (nh * D) % 2) return 1;
  if (seqs < 1 || (cu_q ? cu_q[0] != 0 || cu_q[seqs] != B : seqs != B)) return 1;
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t rows = cu_q ? cu_q[i + 1] - cu_q[i] : 1;
    if (rows < 0 || lens[i] < rows || lens[i] < 1) return 1;
  }
  for (int64_t b = 0; b < B; ++b)
    if (slots[b] < 0 || slots[b] >= num_slots) return 2 + (int)b;
  const int64_t nq = nh * D, nk = nkv * D, nqkv = nq + 2 * nk, nqk = nq + nk;
  // Scratch kept between calls (one caller thread: the shard's model runner).
  // Each part starts on a cache line: the GEMM's tiles load 64-byte rows of them, which
  // otherwise straddle two lines (a 2044-row prefill step took 1.06x).
  static thread_local pagemill::line_vector<bf16> buf;
  const auto lines = [](int64_t n) { return (n + 31) / 32 * 32; };
  buf.resize(lines(B * H) * 2 + lines(B * nqkv) + lines(B * nqk) + lines(B * nq) + lines(B * I));
  bf16* h = buf.data();
  bf16 *qkv = h + lines(B * H), *qk = qkv + lines(B * nqkv), *attn = qk + lines(B * nqk), *o = attn + lines(B * nq);
  bf16* act = o + lines(B * H);
  const bf16 *in_norm = (const bf16*)ptrs[kInNorm], *post_norm = (const bf16*)ptrs[kPostNorm];
  // The linears' shares of the team, adapted layer by layer (team_balance.h says why).
  pagemill::balance::TeamBalance* const balance = pagemill::balance::begin_team(threads);

  // The layer's stages before and after attention; each thread runs them inside a region.
  const auto before = [&] {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      if (first) {
        memcpy(residual + b * H, x + b * H, H * sizeof(bf16));
        pagemill::rows::norm_row(x + b * H, in_norm, eps, H, h + b * H);
      } else {
        pagemill::rows::add_norm_row(x + b * H, residual + b * H, in_norm, eps, H, residual + b * H, h + b * H);
      }
    }
    linear(h, ptrs[kQkvW], ptrs[kQkvB], qkv, B, nqkv, H, balance);
    // q and k rotated into qk [B, nh + nkv, D]; k and v (unrotated) into their slots.
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < nh + nkv; ++j)
        pagemill::rows::rotary_head(qkv + b * nqkv + j * D, cos + b * D, sin + b * D, D, qk + (b * nqk + j * D));
      memcpy(k_cache + slots[b] * nk, qk + b * nqk + nq, nk * sizeof(bf16));
      memcpy(v_cache + slots[b] * nk, qkv + b * nqkv + nqk, nk * sizeof(bf16));
    }
  };
  const auto after = [&] {
    linear(attn, ptrs[kOW], 0, o, B, H, nq, balance);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b)
      pagemill::rows::add_norm_row(o + b * H, residual + b * H, post_norm, eps, H, residual + b * H, h + b * H);
    linear(h, ptrs[kGateUpW], ptrs[kGateUpB], act, B, 2 * I, H, balance, true);  // silu(gate) * up
    linear(act, ptrs[kDownW], ptrs[kDownB], x, B, H, I, balance);
  };
  // The prompt chunks of sequences `from`.. (each attends causally to its cache, its own rows,
  // just written, last); their rows' positions in qk and attn stay absolute (cu_q's).
  const auto prefill_chunks = [&](int64_t from) {
    return pagemill::prefill_batch<bf16>(qk, nqk, k_cache, v_cache, block_tables + from * width, width, cu_q + from,
                                         lens + from, attn, seqs - from, nh, nkv, D, bs, scale, window, threads);
  };
  // Sequences of one row attend as a decode step's do: all of a decode step's, and the leading
  // ones of a mixed step (its decode rows, planned first), whose chunk kernel took 0.35 against
  // 0.31 ms a layer for 64 such rows at context ~160. The prompt chunks after them attend through
  // prefill_attention.h. The module path splits them the same way (attention/torch_backend.py).
  int64_t singles = 0;
  while (singles < seqs && (!cu_q || cu_q[singles + 1] - cu_q[singles] == 1)) ++singles;
  const bool chunks = singles < seqs;
#if defined(__AVX512F__)
  if (singles > 0 && pagemill::spans_apply<bf16>(D, nh / nkv)) {
    // One region: attention's tasks shared by the team between the stages. The spans
    // are cut as attend_batch cuts them (bit for bit the module path), whichever
    // threads then run them.
    const bool parallel = pagemill::attend_takes_threads(lens, singles, nh, D);
    const pagemill::SpanPlan plan = pagemill::plan_spans(lens, singles, nh, D, parallel ? threads : 1);
    static thread_local std::vector<float> parts;
    parts.resize(plan.parts_floats());
    float* const parts_data = parts.data();
#pragma omp parallel num_threads(threads)
    {
      before();
      pagemill::attend_spans_in_region(qk, nqk, k_cache, v_cache, block_tables, width, lens, attn, singles, nh, nkv,
                                       D, bs, scale, window, plan, parts_data);
      if (!chunks) after();
    }
    const int rc = chunks ? prefill_chunks(singles) : 0;
    if (chunks && !rc) {
#pragma omp parallel num_threads(threads)
      after();
    }
    pagemill::balance::end_team(balance);
    return rc ? 1 : 0;
  }
#endif
#pragma omp parallel num_threads(threads)
  before();
  int rc = singles > 0 ? pagemill::attend_batch<bf16, bf16>(qk, nqk, k_cache, v_cache, block_tables, width, lens,
                                                            attn, singles, nh, nkv, D, bs, scale, window, threads)
                       : 0;
  if (!rc && chunks) rc = prefill_chunks(singles);
  if (!rc) {
#pragma omp parallel num_threads(threads)
    after();
  }
  pagemill::balance::end_team(balance);
  return rc ? 1 : 0;
}

}  // namespace

extern "C" {

int pagemill_decode_batched_ptrs() { return kNumPtrs; }
int pagemill_decode_batched_dims() { return kNumDims; }

// Every layer of the model in one call (each_layer.h: the tables, each of the Ptr entries above,
// pools and windows; the code and index of a failing layer).
// x [B, H] (B rows): in, the embedded tokens; out, the last layer's MLP output. residual [B, H]: the
// stream it adds to (the first layer sets it). cos/sin [B, D]. cu_q null: B one-token
// sequences (a decode step; seqs == B); else the rows of `seqs` sequences with prompt chunks (a
// prefill or mixed step): sequence i's rows are cu_q[i]..cu_q[i+1]-1 (cu_q [seqs + 1] int32,
// cu_q[seqs] == B). lens[i]: sequence i's keys after the step (its new rows' among them,
// last), block_tables [seqs, width]. Row b's k/v go to flat slot slots[b] of every layer's
// pools (num_slots rows each) before attention reads them. All tensors bf16 except the int
// tables; K of every linear even (the packed layout). Returns 0; else the first failing
// layer's code (1: a bad shape; 2 + b: row b's slot is outside the pool; nothing of that
// layer written, the layers before it done) with its index in *failed.
int pagemill_batched_layers_bf16(bf16* x, bf16* residual, int64_t B, int64_t layers, const int64_t* tables,
                                 const int64_t* dims, float eps, float scale, const bf16* cos, const bf16* sin,
                                 const int64_t* kv, const int32_t* block_tables, int64_t width, const int32_t* lens,
                                 const int32_t* cu_q, int64_t seqs, const int64_t* slots, int64_t num_slots,
                                 const int64_t* windows, int threads, int64_t* failed) {
  return pagemill::each_layer(layers, tables, kv, windows, failed,
                              [&](int64_t i, const int64_t* ptrs, void* k, void* v, int64_t window) {
                                return layer(x, residual, i == 0, B, ptrs, dims, eps, scale, cos, sin, (bf16*)k,
                                             (bf16*)v, block_tables, width, lens, cu_q, seqs, slots, num_slots,
                                             window, threads);
                              });
}
}
