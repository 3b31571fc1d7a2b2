"""Tiny tokenizer vocabularies for test GGUF files, in the forms llama.cpp writes them.

Trained on a few sentences with `tokenizers` so that merges are real: a byte-level BPE
("gpt2": tokens, merges) and SentencePiece-style vocabularies ("llama": pieces with scores,
<0xXX> byte tokens, control tokens) shaped as Llama 2 / Mistral, Gemma (its own special
tokens, runs of spaces stored as spaces) and Phi-3 (its chat markers) ship them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Numbers like 12345 and 3.14159 appear in the year 2024 and in 1999.",
    "She sells sea shells by the sea shore, and the shells she sells are sea shells.",
    "def main():\n    print('hello world')\n    return 0\n",
    "In the beginning the universe was created. This has made a lot of people very angry.",
]
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model
    pre: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)  # bos / eos / unk / pad -> id
    add_bos: bool = False
    chat_template: str | None = None


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
GEMMA_CHAT = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
              "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")  # fmt: skip


def _train(size: int, pre: pre_tokenizers.PreTokenizer, alphabet: list[str]) -> tuple[dict[str, int], list[str]]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=size, initial_alphabet=alphabet, show_progress=False, min_frequency=1)
    tok.train_from_iterator(CORPUS * 3, trainer)
    m = json.loads(tok.to_str())["model"]
    return m["vocab"], [" ".join(x) if isinstance(x, list) else x for x in m["merges"]]


def byte_level_vocab(size: int, pre: str = "smollm") -> Vocab:
    """Byte-level BPE of exactly `size` tokens: 3 ChatML control tokens, then the trained vocab."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # Trained under the split the file's pre-tokenizer names, as the real vocabularies are
    # (SmolLM's has no token of two digits: its training split them one by one).
    pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if pre == "smollm" else byte_level  # fmt: skip
    vocab, merges = _train(size - len(specials) + 40, pre_tok, pre_tokenizers.ByteLevel.alphabet())
    ordered = sorted(vocab, key=vocab.get)
    # Keep the merges whose result is kept, so the BPE stays consistent.
    keep = ordered[: size - len(specials)]
    kept = set(keep)
    merges = [m for m in merges if "".join(m.split(" ")) in kept and all(p in kept for p in m.split(" "))]
    tokens = specials + keep
    return Vocab("gpt2", pre, tokens, [CONTROL] * 3 + [NORMAL] * len(keep), merges=merges,
                 ids={"bos": 1, "eos": 2, "unk": 0, "pad": 0}, chat_template=CHATML)  # fmt: skip


def sentencepiece_vocab(size: int, flavour: str = "llama") -> Vocab:
    """SentencePiece vocab of exactly `size` tokens; flavour: llama (Llama 2 / Mistral), gemma, phi3."""
    if flavour == "gemma":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
        ids = {"pad": 0, "eos": 1, "bos": 2, "unk": 3}
    else:
        specials = ["<unk>", "<s>", "</s>"] + (["<|user|>", "<|assistant|>", "<|end|>"] if flavour == "phi3" else [])
        ids = {"unk": 0, "bos": 1, "eos": 2}
    types = [CONTROL] * len(specials)
    types[ids["unk"]] = 2  # UNKNOWN
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    room = size - len(specials) - len(byte_tokens) - (2 if flavour == "gemma" else 0)
    vocab, _ = _train(room + 40, pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first"), [])
    pieces = sorted(vocab, key=vocab.get)[:room]
    extra = ["  ", "   "] if flavour == "gemma" else []  # Gemma stores runs of spaces as spaces
    tokens = specials + byte_tokens + extra + pieces
    token_types = types + [BYTE] * 256 + [USER_DEFINED if flavour == "gemma" else NORMAL] * len(extra) + \
        [NORMAL] * len(pieces)  # fmt: skip
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(extra) + len(pieces))]
    return Vocab("llama", "default", tokens, token_types, scores=scores, ids=ids, add_bos=True,
                 chat_template=GEMMA_CHAT if flavour == "gemma" else None)  # fmt: skip
