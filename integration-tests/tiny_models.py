"""Tiny random-weight checkpoints of any transformers architecture, with the default model's
tokenizer so that the router can serve them (integration tests of the model families)."""

import shutil
from pathlib import Path

SMOLLM2_VOCAB = 49152


def save_tiny_model(out: Path, default_model_dir: Path, config_class: str, **config) -> Path:
    """Weights drawn wider than transformers' init (std 0.02 gives near-uniform logits, where greedy
    ties would depend on rounding), saved in float32 with save_pretrained."""
    import torch
    import transformers

    cfg = getattr(transformers, config_class)(vocab_size=SMOLLM2_VOCAB, bos_token_id=1, eos_token_id=2, **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, out / name)
    return out


def hf_greedy(model_dir: Path, prompts: list[str], max_new: int) -> list[list[int]]:
    """transformers' own greedy generation (eager attention, float32), one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=2)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out
