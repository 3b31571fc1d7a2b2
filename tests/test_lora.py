"""LoRA adapters on the shard (server/pagemill/lora/) against PEFT as the reference.

Tiny random-weight models with random PEFT adapters of ranks 8 and 16 (lora_B randomised:
PEFT initialises it to zero, which would hide every bug), saved with PEFT's save_pretrained.
The reference for each adapter is PEFT's merged model (merge_and_unload) run by transformers:
greedy tokens equal, logprobs within 1e-4 in float32, for the base and four adapters mixed in
one batch, with a late joiner, after a preemption, on the compiled CPU kernels and on the torch
reference path; then the pool's LRU eviction of adapters no running request uses. The other
architectures and tensor parallelism: test_lora_architectures.py; int8, GGUF and
--batch-invariant bases: test_lora_bases.py; what is refused: test_lora_refusals.py.
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_model_dir, load_hf
from pagemill.bench.block_router import BlockRouter
from pagemill.lora.adapter import read_adapter, scaling
from pagemill.models.loader import load_model
from pagemill.proto import pb
from pagemill.shard.model_runner import ModelRunner

BLOCK = 4
NEW = 6
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, rslora, target modules): two ranks, rslora, partial targets (a fused
# q/k/v or gate/up linear with only some of its parts adapted)
ADAPTERS = {
    "all8": (8, 16, False, ALL),
    "attn16": (16, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp8_rslora": (8, 4, True, ["gate_proj", "up_proj", "down_proj"]),
    "qv16_rslora": (16, 32, True, ["q_proj", "v_proj", "down_proj"]),
}
PROMPTS = [[5, 17, 99, 42, 7, 250, 3], [60, 61], [1, 200, 13, 14, 15, 16, 17, 18, 19, 20], [9] * 9, [33, 34, 35]]


def make_adapter(model_dir: str, out: str, rank: int, alpha: float, rslora: bool, targets, seed: int) -> str:
    import peft

    base = load_hf(model_dir)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=list(targets),
                          lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
    model = peft.get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:  # B too: PEFT starts it at zero
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    model.save_pretrained(out)
    return out


def merged(model_dir: str, adapter_dir: str | None):
    import peft

    base = load_hf(model_dir)
    if adapter_dir is None:
        return base
    return peft.PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


@torch.no_grad()
def reference(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (never stopping at EOS) and their float32 logprobs."""
    tokens, lps = list(prompt), []
    for _ in range(n):
        logp = hf(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
        t = int(logp.argmax())
        tokens.append(t)
        lps.append(float(logp[t]))
    return tokens[len(prompt) :], lps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(str(tmp_path_factory.mktemp("lora_model")), "llama_gqa")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(model_dir, str(root / name), *spec, seed=i)
            for i, (name, spec) in enumerate(ADAPTERS.items())}  # fmt: skip


@pytest.fixture(scope="module")
def refs(model_dir, adapters):
    """(adapter name or None, prompt index) -> (tokens, logprobs) of PEFT's merged model."""
    out = {}
    for name in [None, *ADAPTERS]:
        hf = merged(model_dir, adapters[name] if name else None)
        for i, prompt in enumerate(PROMPTS):
            out[name, i] = reference(hf, prompt, NEW)
    return out


def make_runner(model_dir: str, max_loras: int, max_rank: int = 16, cpu_kernels: bool = False,
                quantize: str | None = None) -> ModelRunner:  # fmt: skip
    model, config = load_model(model_dir, cpu_kernels=cpu_kernels, quantize=quantize)
    runner = ModelRunner(model, config, block_size=BLOCK, kv_cache_memory=4 << 20, model_dir=model_dir,
                         cpu_kernels=cpu_kernels)  # fmt: skip
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                   max_batch_size=8, max_loras=max_loras, max_lora_rank=max_rank))  # fmt: skip
    return runner


IDS = {name: 10 + i for i, name in enumerate(ADAPTERS)}  # the router's ids: any, unique


def adapter_pb(adapters, name: str) -> pb.Adapter:
    return pb.Adapter(id=IDS[name], name=name, path=adapters[name])


def assert_matches(out, ref) -> None:
    tokens, lps = ref
    assert not out.error, out.error
    assert out.ids == tokens
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(lps), atol=1e-4, rtol=0)


def run_one_batch(runner, plan) -> dict:
    """plan: [(pb.Adapter or None, prompt index)] as requests 0.., run to the end together."""
    router = BlockRouter.for_runner(runner)
    for rid, (a, p) in enumerate(plan):
        router.add(rid, PROMPTS[p], NEW, ignore_eos=True, adapter=a)
    return router.run()


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "torch"])
def test_four_adapters_and_the_base_in_one_batch_with_a_late_joiner(model_dir, adapters, refs, cpu_kernels):
    runner = make_runner(model_dir, max_loras=4, cpu_kernels=cpu_kernels)
    router = BlockRouter.for_runner(runner)
    plan = [(None, 0), ("all8", 1), ("attn16", 2), ("mlp8_rslora", 3), ("qv16_rslora", 4)]
    for rid, (name, p) in enumerate(plan):
        router.add(rid, PROMPTS[p], NEW, ignore_eos=True, adapter=adapter_pb(adapters, name) if name else None)
    router.step()
    router.step()
    # Joins two steps late, its prompt in chunks beside the others' decode tokens; its adapter's
    # rows are then not contiguous with those of the request that shares it.
    late = [("all8", 2), (None, 3), ("attn16", 0)]
    for rid, (name, p) in enumerate(late, start=len(plan)):
        router.add(rid, PROMPTS[p], NEW, ignore_eos=True, chunk=3,
                   adapter=adapter_pb(adapters, name) if name else None)  # fmt: skip
    outs = router.run()
    for rid, (name, p) in enumerate(plan + late):
        assert_matches(outs[rid], refs[name, p])
    assert runner.adapters.loads == 4 and runner.adapters.evictions == 0


def test_preempted_request_resumes_with_its_adapter(model_dir, adapters, refs):
    runner = make_runner(model_dir, max_loras=2, cpu_kernels=True)
    router = BlockRouter.for_runner(runner)
    router.add(0, PROMPTS[0], NEW, ignore_eos=True, adapter=adapter_pb(adapters, "qv16_rslora"))
    router.add(1, PROMPTS[1], NEW, ignore_eos=True, adapter=adapter_pb(adapters, "all8"))
    for _ in range(3):
        router.step()
    router.preempt(0)
    req = router.plan()
    assert req.requests[0].new_request.adapter.id == IDS["qv16_rslora"] and req.requests[0].new_request.generated_len
    router.send(req)
    outs = router.run()
    assert_matches(outs[0], refs["qv16_rslora", 0])
    assert_matches(outs[1], refs["all8", 1])
    assert runner.adapters.loads == 2  # resident all along: the resumed request found its adapter


def test_speculative_verification_runs_with_the_adapters(model_dir, adapters, refs):
    """n-gram proposals verified in one forward whose rows carry their requests' adapters."""
    model, config = load_model(model_dir, cpu_kernels=True)
    runner = ModelRunner(model, config, block_size=BLOCK, kv_cache_memory=4 << 20, speculate=3, cpu_kernels=True)
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                   max_batch_size=8, max_loras=2, max_lora_rank=16))  # fmt: skip
    plan = [(adapter_pb(adapters, "all8"), 3), (None, 3), (adapter_pb(adapters, "qv16_rslora"), 0)]
    outs = run_one_batch(runner, plan)
    for rid, (a, p) in enumerate(plan):
        assert_matches(outs[rid], refs[a.name if a else None, p])


def test_rows_are_grouped_per_adapter_once_per_step():
    from pagemill.lora.apply import LoadedAdapter, build_batch

    a, b = (LoadedAdapter(i, str(i), "", 8, {}, 0) for i in (1, 2))
    assert build_batch([None, None], [3, 1], "cpu") is None
    batch = build_batch([a, None, b, a, b], [3, 1, 2, 1, 1], "cpu")
    got = {g.adapter.id: (g.rows.tolist(), g.span) for g in batch.groups}
    assert got == {1: ([0, 1, 2, 6], None), 2: ([4, 5, 7], None)}
    batch = build_batch([None, b, b], [2, 1, 4], "cpu")
    assert [(g.rows.tolist(), g.span) for g in batch.groups] == [([2, 3, 4, 5, 6], (2, 7))]


def test_each_row_gets_its_own_adapters_product():
    """Both ways of computing a step's products (apply.py: padded, and segmented where padding
    would waste too many rows) add exactly each row's own adapter's (x A^T) B^T, nothing to base
    rows, and nothing from an adapter that leaves the linear alone; ranks differ (the padded
    weights pad them); a change of the step's adapters is seen at once."""
    from pagemill.lora.apply import LoadedAdapter, LoraContext, LoraLayer, ModuleWeights, build_batch

    g = torch.Generator().manual_seed(0)
    weights = {r: ModuleWeights(torch.randn(r, 12, generator=g), torch.randn(10, r, generator=g)) for r in (4, 6)}
    a = LoadedAdapter(1, "a", "", 4, {"lin": weights[4]}, 0)
    b = LoadedAdapter(2, "b", "", 6, {"lin": weights[6]}, 0)
    c = LoadedAdapter(3, "c", "", 8, {}, 0)  # adapts other linears only
    ctx = LoraContext()
    layer = LoraLayer("lin", 12, 10, 1, ctx)
    cases = [  # (each row's adapter, whether the padded products take the step)
        ([a, None, b, c, a, b, None], True),  # a and b: 2 rows each, no padding
        ([b, b, None, None, c, c, a], True),  # a 1 row, b 2: one padding row
        ([c, None, c, None, None, None, c], True),  # nothing adapts this linear
        ([a] * 200 + [b] * 3 + [None] * 5, False),  # 200 and 3 rows: 197 padding rows, too many
        ([a] * 100 + [b] * 90 + [None, c] * 10, True),  # 10 padding rows
        ([b, None, a, b], True),  # the same adapters as a step before, other rows
    ]
    # a evicted and loaded again (the same id, a new resident copy): its weights are stacked anew.
    a_again = LoadedAdapter(1, "a", "", 4, {"lin": ModuleWeights(torch.randn(4, 12, generator=g),
                                                                  torch.randn(10, 4, generator=g))}, 0)  # fmt: skip
    cases.append(([b, None, a_again, b], True))
    for users, padded in cases:
        rows = len(users)
        x = torch.randn(rows, 12, generator=g)
        ctx.batch = build_batch(users, [1] * rows, "cpu")
        members = tuple(j for j, grp in enumerate(ctx.batch.groups) if "lin" in grp.adapter.modules)
        if members:
            assert (ctx.batch.padded_rows(members) is not None) == padded
        out = layer(x, torch.zeros(rows, 10))
        want = torch.zeros(rows, 10)
        for i, u in enumerate(users):
            if u is not None and "lin" in u.modules:
                w = u.modules["lin"]
                want[i] = (x[i] @ w.a.T) @ w.b.T
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    ctx.batch = None


def test_rslora_scaling_is_peft_s(adapters):
    assert scaling(32, 16, True) == 8.0 and scaling(32, 16, False) == 2.0
    for name, (rank, alpha, rslora, _) in ADAPTERS.items():
        assert read_adapter(adapters[name], 64).scaling == pytest.approx(alpha / (rank**0.5 if rslora else rank))


def test_lru_eviction_of_adapters_no_running_request_uses(model_dir, adapters, refs):
    """max_loras=2 and four adapters used over time, never more than two at once."""
    runner = make_runner(model_dir, max_loras=2, cpu_kernels=True)
    pool = runner.adapters
    router = BlockRouter.for_runner(runner)
    names = list(ADAPTERS)
    router.add(0, PROMPTS[0], NEW, ignore_eos=True, adapter=adapter_pb(adapters, names[0]))  # long-running
    router.step()
    router.add(1, PROMPTS[1], 2, ignore_eos=True, adapter=adapter_pb(adapters, names[1]))
    while 1 in router.requests:
        router.step()
    assert list(pool.resident) == [IDS[names[0]], IDS[names[1]]]
    # names[0] is the least recently used but request 0 still runs on it: names[1] goes.
    router.add(2, PROMPTS[2], 2, ignore_eos=True, adapter=adapter_pb(adapters, names[2]))
    router.step()
    assert set(pool.resident) == {IDS[names[0]], IDS[names[2]]} and pool.evictions == 1
    outs = router.run()
    # Both idle now: the next one evicts the least recently used (names[0], acquired first).
    router.add(3, PROMPTS[3], NEW, ignore_eos=True, adapter=adapter_pb(adapters, names[3]))
    router.add(4, PROMPTS[4], NEW, ignore_eos=True, adapter=adapter_pb(adapters, names[1]))  # evicted before
    outs = router.run()
    assert set(pool.resident) == {IDS[names[3]], IDS[names[1]]} and pool.loads == 5 and pool.evictions == 3
    assert_matches(outs[0], refs[names[0], 0])
    assert outs[1].ids == refs[names[1], 1][0][:2] and outs[2].ids == refs[names[2], 2][0][:2]
    assert_matches(outs[3], refs[names[3], 3])
    assert_matches(outs[4], refs[names[1], 4])
