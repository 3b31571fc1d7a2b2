"""--batch-invariant (models/batch_invariant.py, attention/invariant_backend.py): a request's
tokens and logprobs are bit-identical alone and inside a crowd whose prompts are chunked
differently, greedy and seeded, in bfloat16 and float32, over the architectures' attention
variants (GQA, sliding windows and soft caps, MoE experts). And the mode computes the same
function as the default paths (within float tolerance)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import VARIANTS as LLAMA_VARIANTS, build_model_dir
from test_gemma import VARIANTS as GEMMA_VARIANTS
from test_models_moe import VARIANTS as MOE_VARIANTS

from pagemill.attention.invariant_backend import BatchInvariantAttention
from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.bench.block_router import BlockRouter
from pagemill.bench.shard_driver import random_prompts, warm_runner
from pagemill.config import ShardConfig, check_batch_invariant
from pagemill.cpu_kernels.invariant import invariant_kernels
from pagemill.models.batch_invariant import TILE_ROWS, Invariant
from pagemill.proto import pb
from pagemill.shard.model_runner import ModelRunner

MODELS = {"llama_gqa": LLAMA_VARIANTS, "gemma2": GEMMA_VARIANTS, "gemma3": GEMMA_VARIANTS,
          "qwen2_moe": MOE_VARIANTS}  # fmt: skip
NEW_TOKENS = 8


def params(i: int) -> pb.NextTokenChooserParameters:
    """Even requests greedy, odd ones sampled with their own seed."""
    if i % 2 == 0:
        return pb.NextTokenChooserParameters(repetition_penalty=1.0)
    return pb.NextTokenChooserParameters(repetition_penalty=1.0, temperature=0.9, do_sample=True, seed=1000 + i,
                                         has_seed=True)  # fmt: skip


def run(runner, prompts, ids, chunk=None):
    """Requests prompts[i] with params(ids[i]), stepped together; the first len(ids) chunked."""
    router = BlockRouter.for_runner(runner)
    for rid, prompt in enumerate(prompts):
        p = params(ids[rid]) if rid < len(ids) else params(rid)
        router.add(rid, prompt, NEW_TOKENS, params=p, ignore_eos=True, chunk=chunk if rid < len(ids) else None)
    outs = router.run()
    return [outs[i] for i in range(len(ids))]


KERNELS = invariant_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C++ compiler for the CPU kernels")
# The two ways the mode runs: the compiled invariant kernels, and torch's ops without them.
PATHS = [pytest.param(True, id="kernels", marks=needs_kernels), pytest.param(False, id="torch")]


def runner_for(path: str, dtype: str, invariant: bool, cpu_kernels: bool = True) -> ModelRunner:
    r = ModelRunner.from_shard_config(ShardConfig(model_dir=path, uds_path="", dtype=dtype,
                                                  batch_invariant=invariant, cpu_kernels=cpu_kernels))  # fmt: skip
    warm_runner(r, max_batch_size=48, max_prefill_tokens=2048, max_input=160)
    return r


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", list(MODELS))
def test_alone_equals_inside_a_crowd(name, dtype, kernels, tmp_path):
    if dtype == "float32" and name != "llama_gqa":
        pytest.skip("float32 on one model: the paths are the same, bf16 is where batches moved bits")
    if not kernels and (name, dtype) != ("llama_gqa", "bfloat16"):
        pytest.skip("torch's path on one model and dtype: the kernels are what runs by default")
    path = build_model_dir(str(tmp_path), name, variants=MODELS[name])
    runner = runner_for(path, dtype, invariant=True, cpu_kernels=kernels)
    vocab = runner.config.vocab_size
    targets = random_prompts(4, 70, vocab, seed=1)
    crowd = random_prompts(36, 45, vocab, seed=2)
    alone = [run(runner, [p], [i])[0] for i, p in enumerate(targets)]
    together = run(runner, targets + crowd, list(range(4)), chunk=23)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert not a.error and not b.error
        assert a.ids == b.ids, f"request {i} ({'greedy' if i % 2 == 0 else 'seeded'}): tokens differ"
        assert a.logprobs == b.logprobs, f"request {i}: logprobs differ in their bits"


@pytest.mark.parametrize("kernels", PATHS)
def test_same_function_as_the_default_paths(llama_dir, kernels):
    """float32: the invariant mode's greedy tokens and logprobs are the default paths' (1e-4)."""
    prompts = random_prompts(3, 40, 256, seed=3)
    outs = {}
    for invariant in (False, True):
        runner = runner_for(llama_dir, "float32", invariant, cpu_kernels=kernels or not invariant)
        prompts = [[t % runner.config.vocab_size for t in p] for p in prompts]
        outs[invariant] = run(runner, prompts, [0, 2, 4])
    for a, b in zip(outs[False], outs[True]):
        assert a.ids == b.ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-4)


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, TILE_ROWS - 1, TILE_ROWS, 3 * TILE_ROWS + 5, 100])
def test_invariant_linear_is_linear_and_row_independent(rows, dtype, kernels):
    """Shapes off every tile and vector width (K = 83, N = 98); more rows than one row block."""
    linear = Invariant(KERNELS if kernels else None).linear
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(98, 83, generator=g).to(dtype), torch.randn(98, generator=g).to(dtype)
    x = torch.randn(rows, 83, generator=g).to(dtype)
    y = linear(x, w, b)
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), b.float()), **tol)
    # Each row alone, and any run of rows, gives the same bits as inside the batch.
    for i in range(rows):
        assert torch.equal(linear(x[i : i + 1], w, b), y[i : i + 1])
    assert torch.equal(linear(x[rows // 3 :], w, b), y[rows // 3 :])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x, w, b), y), "the thread count moved bits"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 3.0)])
def test_invariant_attention_matches_the_reference(window, softcap, kernels):
    """Two sequences with cached prefixes (one across block boundaries) and one fresh prompt."""
    g = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    query_lens, kv_lens = [3, 1, 5], [9, 14, 5]
    tables = [[0, 1, 2], [3, 4, 5, 6], [7, 8]]
    slots = [b * block_size + o for n, t, table in zip(query_lens, kv_lens, tables)
             for b, o in (divmod(p, block_size) for p in range(t - n, t)) for b in [table[b]]]  # fmt: skip
    meta = make_metadata(is_prefill=True, query_lens=query_lens, kv_lens=kv_lens, block_tables=tables,
                         slot_mapping=slots, device="cpu")  # fmt: skip
    k_cache = torch.randn(10, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(10, block_size, kv_heads, dim, generator=g)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, dim, generator=g)
    k, v = torch.randn(tokens, kv_heads, dim, generator=g), torch.randn(tokens, kv_heads, dim, generator=g)
    ref, ours = TorchAttentionBackend(), BatchInvariantAttention(KERNELS if kernels else None)
    ref.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    want = ref.prefill(q, k, v, k_cache, v_cache, meta, 0.35, window, softcap)
    got = ours.prefill(q, k, v, k_cache, v_cache, meta, 0.35, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The last sequence's tokens alone (a step of their own) give the same bits.
    alone = make_metadata(is_prefill=True, query_lens=[5], kv_lens=[5], block_tables=[tables[2]],
                          slot_mapping=slots[-5:], device="cpu")  # fmt: skip
    assert torch.equal(ours.prefill(q[-5:], k[-5:], v[-5:], k_cache, v_cache, alone, 0.35, window, softcap), got[-5:])


def test_refuses_what_it_cannot_hold():
    base = dict(uds_path="", batch_invariant=True)
    check_batch_invariant(ShardConfig(model_dir="m", **base))
    check_batch_invariant(ShardConfig(model_dir="m.gguf", gguf_weights="dequantized", **base))
    for extra, name in ((dict(quantize="int8"), "--quantize"), (dict(kv_cache_dtype="int8"), "--kv-cache-dtype"),
                        (dict(device="cuda"), "--device cuda"), (dict(speculate=2), "--speculate"),
                        (dict(model_impl="transformers"), "--model-impl"),
                        (dict(model_dir="m.gguf"), "GGUF kept quantized")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            check_batch_invariant(ShardConfig(**{"model_dir": "m", **base, **extra}))
