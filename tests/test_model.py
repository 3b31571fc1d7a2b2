"""Our paged Llama-family model against Hugging Face transformers (float32).

PagedHarness feeds the model directly (no shard); its block ids come from
the BlockRouter's `Blocks` (shuffled, a new block whenever a sequence crosses
a block boundary, as the real router does).
"""

from __future__ import annotations

import pytest
import torch

from pagemill.attention.metadata import make_metadata
from pagemill.models.config import ModelConfig
from pagemill.models.loader import load_model
from pagemill.bench.block_router import Blocks
from pagemill.shard.kv_pool import KVPool

BLOCK_SIZE = 4
REL_TOL = 1e-4


class PagedHarness:
    def __init__(self, model, config: ModelConfig, num_blocks: int = 96, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        """dtype: the KV pool's (the server makes it the model's)."""
        self.model = model
        self.pool = KVPool.with_blocks(config, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=dtype, device="cpu")
        self.blocks = Blocks(num_blocks, BLOCK_SIZE, seed)  # the router's arithmetic (bench/block_router.py)
        self.tables: dict[int, list[int]] = {}

    def _slots(self, sid: int, start: int, end: int) -> list[int]:
        return self.blocks.slots(self.tables.setdefault(sid, []), start, end)

    @torch.no_grad()
    def prefill(self, seqs: dict[int, list[int]], cache_lens: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        """Computes tokens[cache_len:] of each sequence; returns their logits [n_new, V]."""
        cache_lens = cache_lens or {}
        ids, positions, slots, qlens, klens, tables = [], [], [], [], [], []
        for sid, tokens in seqs.items():
            c = cache_lens.get(sid, 0)
            ids += tokens[c:]
            positions += range(c, len(tokens))
            slots += self._slots(sid, c, len(tokens))
            qlens.append(len(tokens) - c)
            klens.append(len(tokens))
            tables.append(self.tables[sid])
        meta = make_metadata(
            is_prefill=True, query_lens=qlens, kv_lens=klens, block_tables=tables, slot_mapping=slots, device="cpu"
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.pool.kv_caches)
        logits = self.model.compute_logits(hidden)
        return dict(zip(seqs, logits.split(qlens)))

    @torch.no_grad()
    def decode(self, seqs: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feeds the last token of each sequence (its KV is not cached yet)."""
        slots = [self._slots(sid, len(t) - 1, len(t))[0] for sid, t in seqs.items()]
        meta = make_metadata(
            is_prefill=False,
            query_lens=[1] * len(seqs),
            kv_lens=[len(t) for t in seqs.values()],
            block_tables=[self.tables[sid] for sid in seqs],
            slot_mapping=slots,
            device="cpu",
        )
        ids = torch.tensor([t[-1] for t in seqs.values()])
        positions = torch.tensor([len(t) - 1 for t in seqs.values()])
        logits = self.model.compute_logits(self.model(ids, positions, meta, self.pool.kv_caches))
        return {sid: logits[i] for i, sid in enumerate(seqs)}


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """Reference: the whole sequence through transformers, no cache. [len, V]"""
    return hf(torch.tensor([tokens])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < REL_TOL, f"{what}: relative max error {rel:.2e}"


def prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_prefill_and_decode_match_transformers(tiny_model):
    check_prefill_and_decode(*tiny_model)


def test_default_model_matches_transformers(default_model_dir):
    """The same check on SmolLM2-135M-Instruct (GQA 9/3, 30 layers, tied embeddings)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    check_prefill_and_decode("smollm2", str(default_model_dir), hf)


def check_prefill_and_decode(name, model_dir, hf, cpu_kernels: bool = True) -> None:
    model, config = load_model(model_dir, "float32", "cpu", cpu_kernels=cpu_kernels)
    h = PagedHarness(model, config)
    p = prompts(config.vocab_size, [7, 13, 1, 10])
    seqs = {0: p[0], 1: p[1], 2: p[2]}
    late = {3: p[3]}  # prefilled after join_at decode steps, then joins the running batch
    join_at, steps = 6, 20
    # (what, seq id, first position, logits [n, V]): logits of positions first..first+n-1
    seen: list[tuple[str, int, int, torch.Tensor]] = []

    def record_and_extend(logits: dict[int, torch.Tensor], what: str) -> None:
        for sid, lg in logits.items():
            lg = lg if lg.dim() == 2 else lg[None]
            seen.append((what, sid, len(seqs[sid]) - lg.shape[0], lg))
            seqs[sid] = seqs[sid] + [int(lg[-1].argmax())]  # greedy: both sides see this token

    record_and_extend(h.prefill(seqs), "prefill")
    for step in range(steps):
        if step == join_at:
            logits = h.prefill(late)
            seqs.update(late)
            record_and_extend(logits, "late prefill")
        record_and_extend(h.decode(seqs), f"decode step {step}")

    # HF is causal, so one no-cache forward of each final sequence gives the
    # reference logits of every step at once (row p: next-token logits after p).
    ref = {sid: hf_logits(hf, tokens) for sid, tokens in seqs.items()}
    for what, sid, first, lg in seen:
        assert_close(lg, ref[sid][first : first + lg.shape[0]], f"{name} {what} seq {sid}")
    assert sum(w.startswith("decode") for w, *_ in seen) == 3 * steps + (steps - join_at)
    # Sequences grew across block boundaries: one block per BLOCK_SIZE tokens.
    for sid, tokens in seqs.items():
        assert len(h.tables[sid]) == -(-(len(tokens) - 1) // BLOCK_SIZE)


def test_cached_prefix_gives_same_logits(tiny_model):
    """cache_len > 0: the prefix's KV is in blocks already, only the suffix is computed."""
    name, model_dir, hf = tiny_model
    model, config = load_model(model_dir, "float32", "cpu")
    h = PagedHarness(model, config, seed=3)
    (base,) = prompts(config.vocab_size, [14], seed=5)
    h.prefill({0: base})

    # Block-aligned shared prefix (what the router's radix cache hands out):
    # request 1 reuses request 0's first two blocks and computes 7 new tokens.
    shared = 2 * BLOCK_SIZE
    (suffix,) = prompts(config.vocab_size, [7], seed=6)
    other = base[:shared] + suffix
    h.tables[1] = h.blocks.share(h.tables[0][:shared // BLOCK_SIZE])
    logits = h.prefill({1: other}, cache_lens={1: shared})[1]
    assert logits.shape[0] == len(suffix)
    assert_close(logits, hf_logits(hf, other)[shared:], f"{name} aligned cached prefix")

    # Unaligned cache_len (a recompute of the request's own tail): positions
    # 10..13 recomputed in place, several new tokens attending to 10 cached ones.
    logits = h.prefill({0: base}, cache_lens={0: 10})[0]
    assert_close(logits, hf_logits(hf, base)[10:], f"{name} unaligned cached prefix")

    # And decode keeps working on top of the shared blocks.
    other = other + [5]
    assert_close(h.decode({1: other})[1], hf_logits(hf, other)[-1], f"{name} decode after cached prefix")


def test_block_tables_are_really_shuffled(llama_dir):
    model, config = load_model(llama_dir, "float32", "cpu")
    h = PagedHarness(model, config)
    h.prefill({0: prompts(config.vocab_size, [20])[0]})
    table = h.tables[0]
    assert len(table) == 5 and table != sorted(table) and 0 not in table


def test_bfloat16_model_tracks_float32_reference(llama_dir):
    from conftest import load_hf

    model, config = load_model(llama_dir, "bfloat16", "cpu")
    assert model.lm_head.weight.dtype == torch.bfloat16
    h = PagedHarness(model, config)
    (tokens,) = prompts(config.vocab_size, [12], seed=9)
    ours = h.prefill({0: tokens})[0]
    ref = hf_logits(load_hf(llama_dir), tokens)
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert ours.dtype == torch.float32 and rel < 5e-2


def test_config_parsing_and_errors():
    base = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4)  # fmt: skip
    c = ModelConfig.from_dict(base, {"eos_token_id": [7, 8]} )
    assert c.num_key_value_heads == 4 and c.head_dim == 16 and c.rope_scaling is None and c.rope_theta == 10000.0
    assert c.eos_token_ids == (7, 8)
    # classic HF keys (transformers 4.x): rope_theta + rope_scaling with "type"
    c = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0},
                               "eos_token_id": 2, "num_key_value_heads": 1}, {"eos_token_id": 7})  # fmt: skip
    assert c.rope_theta == 5e5 and c.rope_scaling.rope_type == "linear" and c.eos_token_ids == (7, 2)
    assert ModelConfig.from_dict({**base, "model_type": "qwen2"}).attention_bias
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_dict({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="not a multiple"):
        ModelConfig.from_dict({**base, "num_key_value_heads": 3})


def test_loader_reports_missing_weights(tmp_path, llama_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copy(f"{llama_dir}/config.json", tmp_path)
    weights = load_file(f"{llama_dir}/model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing 1 weights: lm_head.weight .*tie_word_embeddings"):
        load_model(str(tmp_path))
