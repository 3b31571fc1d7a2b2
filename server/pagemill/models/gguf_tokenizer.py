"""Rebuild a `tokenizers` tokenizer.json from a GGUF's tokenizer metadata.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is handled: that is
what SmolLM2 and most BPE llama-family GGUFs carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (gguf.TokenType).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

# `tokenizer.ggml.pre` values whose llama.cpp split is "\p{N}" (each digit
# alone) followed by the GPT-2 regex: Digits(individual) + ByteLevel in HF terms.
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r")
# Plain GPT-2 regex split.
GPT2_PRE = ("default", "gpt2", "mpt", "olmo")


@dataclass(frozen=True)
class TokenizerSpec:
    """What the GGUF says about its tokenizer."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    model: str
    pre: str
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    model_max_length: int


def pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in GPT2_PRE:
        return byte_level
    raise ValueError(
        f"unsupported tokenizer.ggml.pre {pre!r}: known {sorted(DIGIT_SPLIT_PRE + GPT2_PRE)}"
    )


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    if spec.model != "gpt2":
        raise ValueError(f"unsupported tokenizer.ggml.model {spec.model!r}: only byte-level BPE ('gpt2')")
    vocab = {tok: i for i, tok in enumerate(spec.tokens)}
    if len(vocab) != len(spec.tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    # Byte-level tokens never hold a raw space, so "a b" splits unambiguously.
    merges = [tuple(m.split(" ", 1)) for m in spec.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer(spec.pre)
    tok.decoder = decoders.ByteLevel()
    # Offsets only; SmolLM2's own tokenizer.json uses the same post-processor.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control/user-defined tokens must match whole in raw text (chat markup),
    # never be split by BPE. They are already in the vocab, so ids are kept.
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(spec.tokens, spec.token_types)
        if ty == TOKEN_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(spec.tokens, spec.token_types)
        if ty == TOKEN_USER_DEFINED
    ]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(spec.tokens):
        raise ValueError("added tokens grew the vocabulary: GGUF token types and vocab disagree")
    return tok


def _token(spec: TokenizerSpec, token_id: int | None) -> str | None:
    return None if token_id is None else spec.tokens[token_id]


def tokenizer_config(spec: TokenizerSpec) -> dict[str, Any]:
    """tokenizer_config.json: special-token strings and the chat template."""
    cfg: dict[str, Any] = {
        # Generic fast tokenizer: loads tokenizer.json as written, no rebuilt pipeline.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(spec, spec.bos_token_id),
        "eos_token": _token(spec, spec.eos_token_id),
        "pad_token": _token(spec, spec.pad_token_id),
        "unk_token": _token(spec, spec.unk_token_id),
        "add_bos_token": spec.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.model_max_length,
    }
    if spec.chat_template:
        cfg["chat_template"] = spec.chat_template
    return cfg
