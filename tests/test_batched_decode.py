"""The batched bf16 decode layer (cpu_kernels/csrc/decode/decode_batched.cpp, models/batched_decode.py).

It runs the module path's functions in one call per layer, so its logits must
equal the module path's bit for bit: every tiny variant and the default
model, decode steps across block boundaries, steps with prompt chunks (fresh,
over a cached prefix, and mixed with decode rows), sliding windows, one and
two threads. Against transformers it is covered by test_bf16_decode's batched
test (which now takes this path). Skipped where the kernels cannot be built;
on a CPU without AVX512-BF16 the bf16 linears are oneDNN's and the decoder
must not be built.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_decode import Spy
from test_model import PagedHarness, prompts

from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.decode import decode_kernels
from pagemill.cpu_kernels.gemm import gemm_bf16_kernel
from pagemill.models.batched_decode import BatchedDecoder
from pagemill.models.loader import load_model

kernels = decode_kernels()
gemm = gemm_bf16_kernel()

def load(model_dir, dtype="bfloat16", **kw):
    """As the server loads it on the CPU: attention through the compiled kernels."""
    return load_model(str(model_dir), dtype, "cpu", backend=TorchAttentionBackend(kernels), **kw)


pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ compiler / not x86-64 Linux")
needs_gemm = pytest.mark.skipif(gemm is None or not gemm.fast, reason="bf16 linears are oneDNN's on this CPU")


def compare_steps(model, config, lens: list[int], steps: int, num_blocks: int = 96) -> int:
    """Prefill, then `steps` decode steps, each computed by the module path and then by the batched
    decoder over the same cache; asserts equal logits. Returns the batched decoder's calls."""
    batched = model.model.batched
    spy = Spy(batched)
    h = PagedHarness(model, config, num_blocks=num_blocks, dtype=torch.bfloat16)
    seqs = dict(enumerate(prompts(config.vocab_size, lens)))
    for sid, lg in h.prefill(seqs).items():
        seqs[sid] = seqs[sid] + [int(lg[-1].argmax())]
    for step in range(steps):
        model.model.batched = None
        ref = h.decode(seqs)  # writes this step's k/v; the batched step rewrites the same values
        model.model.batched = spy
        out = h.decode(seqs)
        for sid in seqs:
            assert torch.equal(out[sid], ref[sid]), f"step {step} seq {sid}: batched differs from the module path"
            seqs[sid] = seqs[sid] + [int(out[sid].argmax())]
    model.model.batched = batched
    return spy.calls


def compare_chunk_steps(model, config, lens: list[int], num_blocks: int = 96) -> int:
    """Steps with prompt chunks, each computed by the module path and then by the batched layer
    over the same cache, every row's logits equal: the first half of each prompt of `lens`
    (fresh), then a mixed step (each of those sequences' next token as a one-token row, the
    second halves over their cached first halves, and a fresh prompt), its rows interleaved,
    then the same step with its one-token rows first, as the router plans them (those attend
    as a decode step's). Returns the batched layer's calls."""
    batched = model.model.batched
    spy = Spy(batched)
    h = PagedHarness(model, config, num_blocks=num_blocks, dtype=torch.bfloat16)
    full = prompts(config.vocab_size, lens + [max(lens)], seed=3)
    fresh = {sid: t for sid, t in enumerate(full[:-1])}
    halves = {sid: t[: max(1, len(t) // 2)] for sid, t in fresh.items()}

    def step(seqs, cache_lens, what):
        model.model.batched = None
        ref = h.prefill(seqs, cache_lens)  # writes the step's k/v; the batched step rewrites the same values
        model.model.batched = spy
        out = h.prefill(seqs, cache_lens)
        for sid in seqs:
            assert torch.equal(out[sid], ref[sid]), f"{what}, seq {sid}: batched differs from the module path"
        return out

    out = step(halves, {}, "fresh prompts")
    seqs = {sid: t + [int(out[sid][-1].argmax())] for sid, t in halves.items()}  # decode rows
    cache_lens = {sid: len(t) - 1 for sid, t in seqs.items()}
    odd = [sid for sid in fresh if sid % 2]  # these continue their prompts instead
    for sid in odd:
        seqs[sid], cache_lens[sid] = fresh[sid], len(halves[sid])
    seqs[len(fresh)] = full[-1]  # and a new prompt joins
    step(seqs, cache_lens, "mixed step")
    decode_first = sorted(seqs, key=lambda sid: len(seqs[sid]) - cache_lens.get(sid, 0) != 1)
    assert len(seqs[decode_first[1]]) - cache_lens[decode_first[1]] == 1, "two or more decode rows lead"
    step({sid: seqs[sid] for sid in decode_first}, cache_lens, "mixed step, decode rows first")
    model.model.batched = batched
    return spy.calls


@needs_gemm
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_equals_module_path(tiny_model, threads):
    name, model_dir, _ = tiny_model
    model, config = load(model_dir)
    assert model.model.batched is not None, f"{name}: a plain bf16 Llama-family model builds the batched decoder"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # 7 sequences (above the fused layer's batch), 1..13 tokens: 9 steps cross blocks of 4.
        assert compare_steps(model, config, [6, 1, 9, 4, 13, 2, 5], steps=9) == 9
        assert compare_chunk_steps(model, config, [6, 1, 9, 4, 13]) == 3
    finally:
        torch.set_num_threads(before)


@needs_gemm
def test_batched_equals_module_path_with_sliding_windows(llama_dir):
    model, config = load(llama_dir)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.sliding_window = 5 if i == 0 else 3  # windows cutting blocks of 4 mid-block
    model.model.batched = BatchedDecoder.build(model, kernels)
    assert compare_steps(model, config, [12, 3, 7, 1, 9, 20], steps=6) == 6
    assert compare_chunk_steps(model, config, [12, 3, 17, 9]) == 3


@needs_gemm
def test_batched_equals_module_path_on_default_model(default_model_dir):
    """SmolLM2 (GQA 9/3, head_dim 64, 30 layers), 12 sequences."""
    model, config = load(default_model_dir)
    assert model.model.batched is not None
    assert compare_steps(model, config, [21, 5, 40, 3, 17, 9, 33, 1, 12, 8, 27, 2], steps=3, num_blocks=128) == 3
    # Chunks of 70-150 rows beside one-token rows: the GEMM's prefill walk (over 64 rows).
    assert compare_chunk_steps(model, config, [140, 5, 150, 33, 97], num_blocks=256) == 3


@needs_gemm
@pytest.mark.parametrize("lens", [[150, 171, 133, 190, 162, 145], [330, 301, 345, 318, 322, 311]])
def test_batched_equals_module_path_where_attention_is_cut_into_spans(default_model_dir, lens):
    """6 sequences on two threads: under attend_batch's threshold for the threads (the layer's
    tasks still shared by both) and above it (2 spans a sequence, merged inside the layer)."""
    model, config = load(default_model_dir)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert compare_steps(model, config, lens, steps=2, num_blocks=sum(lens) // 2) == 2
    finally:
        torch.set_num_threads(before)


@needs_gemm
def test_batched_decoder_applies_only_where_it_computes_the_module_path(llama_dir):
    model, config = load(llama_dir)
    batched = model.model.batched
    x = torch.zeros(6, config.hidden_size, dtype=torch.bfloat16)
    caches = [tuple(torch.zeros(8, 4, config.num_key_value_heads, config.head_dim, dtype=torch.bfloat16)
                    for _ in range(2))]  # fmt: skip

    def meta(is_prefill=False, n=6):
        return make_metadata(is_prefill=is_prefill, query_lens=[1] * n, kv_lens=[3] * n, block_tables=[[1]] * n,
                             slot_mapping=list(range(n)), device="cpu")  # fmt: skip

    assert batched.applies(x, meta(), caches)
    model.set_backend(TorchAttentionBackend())  # the torch reference's attention: the module path's
    assert not batched.applies(x, meta(), caches)
    model.set_backend(TorchAttentionBackend(kernels))
    assert batched.applies(x, meta(is_prefill=True), caches)  # steps with prompt chunks too
    assert not batched.applies(x.float(), meta(), caches)
    assert not batched.applies(x, meta(), [tuple(c.float() for c in caches[0])])
    assert not batched.applies(x, meta(), [tuple(c.to(torch.float8_e4m3fn) for c in caches[0])])
    # Never built: --no-cpu-kernels, float32 models, oneDNN's bf16 linears, a weight it does not read.
    assert load_model(llama_dir, "bfloat16", "cpu", cpu_kernels=False)[0].model.batched is None
    assert load_model(llama_dir, "float32", "cpu")[0].model.batched is None
    assert load(llama_dir, quantize="int8")[0].model.batched is None  # int8 linears: not our GEMM
    model.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(config.hidden_size,
                                                                                  dtype=torch.bfloat16))
    assert BatchedDecoder.build(model, kernels) is None
    model, _ = load(llama_dir)
    model.model.layers[1].mlp.down_proj.pack(bf16_linear="onednn")
    assert BatchedDecoder.build(model, kernels) is None


@needs_gemm
def test_batched_decoder_rejects_a_slot_outside_the_pool(llama_dir):
    model, config = load(llama_dir)
    h = PagedHarness(model, config, num_blocks=8, dtype=torch.bfloat16)
    n = 6
    meta = make_metadata(is_prefill=False, query_lens=[1] * n, kv_lens=[1] * n, block_tables=[[1]] * n,
                         slot_mapping=[0, 1, 2, 3, 8 * 4, 5], device="cpu")  # fmt: skip
    with pytest.raises(IndexError, match="outside the pool"):
        model(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), meta, h.pool.kv_caches)
    # A prompt chunk's row likewise; and a sequence with fewer keys than new rows is refused.
    chunk = make_metadata(is_prefill=True, query_lens=[3, 1], kv_lens=[3, 2], block_tables=[[1], [2]],
                          slot_mapping=[4, 5, 8 * 4 + 1, 9], device="cpu")  # fmt: skip
    with pytest.raises(IndexError, match="outside the pool"):
        model(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), chunk, h.pool.kv_caches)
    short = make_metadata(is_prefill=True, query_lens=[3, 1], kv_lens=[2, 2], block_tables=[[1], [2]],
                          slot_mapping=[4, 5, 6, 9], device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="rejected its shapes"):
        model.model.batched(torch.zeros(4, config.hidden_size, dtype=torch.bfloat16),
                            *(torch.ones(4, config.head_dim, dtype=torch.bfloat16),) * 2, short, h.pool.kv_caches)
    # One call runs every layer: a KV cache per layer, or it is refused before anything runs.
    fine = make_metadata(is_prefill=True, query_lens=[3, 1], kv_lens=[3, 2], block_tables=[[1], [2]],
                         slot_mapping=[4, 5, 6, 9], device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="KV caches for"):
        model.model.batched(torch.zeros(4, config.hidden_size, dtype=torch.bfloat16),
                            *(torch.ones(4, config.head_dim, dtype=torch.bfloat16),) * 2, fine, h.pool.kv_caches[:-1])
