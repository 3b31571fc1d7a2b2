"""A GGUF's tokenizer metadata -> tokenizer.json, tokenizer_config.json (with the chat template)
and the end-of-generation ids, the files the router reads.

vocab.py builds the tokenizer model; here the vocabulary's control tokens become special
tokens (matched whole in text, never split), user-defined ones plain added tokens, and the
post-processor adds BOS / EOS where tokenizer.ggml.add_bos_token / add_eos_token say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.types import GGUFError
from pagemill.models.gguf.vocab import ALPHABET, byte_level, sentencepiece

# llama.cpp token types (gguf.TokenType).
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4
# Control tokens that end a chat turn: generation stops at them as at EOS (llama.cpp treats
# them as end-of-generation the same way, by their text).
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>", "<EOT>")


@dataclass(frozen=True)
class TokenizerSpec:
    """What the GGUF says about its tokenizer."""

    arch: str
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    eot_token_ids: tuple[int, ...]  # tokenizer.ggml.eot_token_id / eom_token_id
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    model_max_length: int


def read_spec(g: GGUFModel, model_max_length: int) -> TokenizerSpec:
    def v(key: str, default: Any = None) -> Any:
        return g.value(f"tokenizer.{key}", default)

    tokens = v("ggml.tokens")
    if not tokens:
        raise GGUFError(f"{g.paths[0].name} has no tokenizer (tokenizer.ggml.tokens)")
    model = v("ggml.model")
    return TokenizerSpec(
        arch=g.architecture, model=model, pre=v("ggml.pre", "default"), tokens=tokens,
        scores=v("ggml.scores") or [0.0] * len(tokens), token_types=v("ggml.token_type") or [1] * len(tokens),
        merges=v("ggml.merges") or [], bos_token_id=v("ggml.bos_token_id"), eos_token_id=v("ggml.eos_token_id"),
        pad_token_id=v("ggml.padding_token_id"), unk_token_id=v("ggml.unknown_token_id"),
        eot_token_ids=tuple(i for i in (v("ggml.eot_token_id"), v("ggml.eom_token_id")) if i is not None),
        # SentencePiece vocabularies get BOS unless the file says otherwise (llama.cpp's rule).
        add_bos_token=bool(v("ggml.add_bos_token", model == "llama")), add_eos_token=bool(v("ggml.add_eos_token", False)),
        chat_template=v("chat_template"), model_max_length=model_max_length,
    )  # fmt: skip


def _token(spec: TokenizerSpec, token_id: int | None) -> str | None:
    return None if token_id is None or not 0 <= token_id < len(spec.tokens) else spec.tokens[token_id]


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    if spec.model == "gpt2":
        tok = byte_level(spec.tokens, spec.merges, spec.pre)
    elif spec.model == "llama":
        tok = sentencepiece(spec.tokens, spec.scores, spec.arch, _token(spec, spec.unk_token_id))
    else:
        raise GGUFError(f"unsupported tokenizer.ggml.model {spec.model!r}: pagemill builds 'gpt2' (byte-level BPE) "
                        "and 'llama' (SentencePiece)")  # fmt: skip
    byte = spec.model == "gpt2"
    # Control tokens match whole and are special; in a byte-level vocabulary one spelled outside
    # the byte alphabet is a mislabelled ordinary token and stays one.
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(spec.tokens, spec.token_types)
               if ty == TOKEN_CONTROL and (not byte or set(t) <= ALPHABET)]  # fmt: skip
    # User-defined tokens match whole too, as plain tokens (those the model spells differently,
    # as Gemma its runs of spaces, are left to the model).
    vocab = tok.get_vocab()
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(spec.tokens, spec.token_types)
            if ty == TOKEN_USER_DEFINED and t in vocab]  # fmt: skip
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    tok.post_processor = _post_processor(spec, byte)
    return tok


def _post_processor(spec: TokenizerSpec, byte: bool) -> processors.PostProcessor:
    bos, eos = _token(spec, spec.bos_token_id), _token(spec, spec.eos_token_id)
    add_bos, add_eos = spec.add_bos_token and bos is not None, spec.add_eos_token and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = ([(bos, spec.bos_token_id)] if add_bos else []) + ([(eos, spec.eos_token_id)] if add_eos else [])
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    if not byte:
        return template
    # Byte-level offsets are trimmed of the spaces the pre-tokenizer folds into tokens.
    return processors.Sequence([processors.ByteLevel(trim_offsets=False), template])


def end_of_generation_ids(spec: TokenizerSpec) -> list[int]:
    """EOS, the file's end-of-turn ids, and the control tokens that end a chat turn."""
    ids = [i for i in (spec.eos_token_id, *spec.eot_token_ids) if i is not None]
    for i, (t, ty) in enumerate(zip(spec.tokens, spec.token_types)):
        if ty == TOKEN_CONTROL and t in END_OF_TURN and i not in ids:
            ids.append(i)
    return ids


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
        "add_eos_token": spec.add_eos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.model_max_length,
    }
    if spec.chat_template:
        cfg["chat_template"] = spec.chat_template
    return cfg
