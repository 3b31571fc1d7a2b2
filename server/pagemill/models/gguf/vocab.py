"""The tokenizer models a GGUF vocabulary describes, as `tokenizers` pipelines.

- "gpt2": byte-level BPE with the file's merges, text split first by the regex llama.cpp
  associates with tokenizer.ggml.pre (Llama 3, Qwen2, SmolLM's digits, or GPT-2's);
- "llama": SentencePiece. The file has pieces and scores, no merges: BPE merges are rebuilt
  from the vocabulary (every split of a piece into two pieces), best merged piece first, with
  byte fallback (<0x..> tokens) for anything else. Gemma ranks merges by file order (its scores
  do not follow its merge order) and stores runs of spaces as spaces; Phi-3 prepends the
  space through a normalizer.

These are the pipelines transformers builds from the same GGUF (integrations/gguf's
tokenizer mapping), so a text encodes to the same ids; the tests check it per family.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from pagemill.models.gguf.types import GGUFError

SPACE = "\u2581"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
# tokenizer.ggml.pre -> the regex that splits text before BPE (None: GPT-2's, ByteLevel's own).
PRE_SPLITS: dict[str, str | None] = {
    **dict.fromkeys(("default", "gpt2", "mpt", "olmo"), None),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# Each digit on its own, then GPT-2's regex (llama.cpp's split for these).
DIGIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level vocabularies use)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTES = _byte_alphabet()
ALPHABET = frozenset(BYTES.values())


def byte_level(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    # A token spelled outside the byte alphabet (a mislabelled added token) is respelled byte by byte.
    vocab = {(t if set(t) <= ALPHABET else "".join(BYTES[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                               continuing_subword_prefix="", end_of_word_suffix=""))  # fmt: skip
    if pre in DIGIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])  # fmt: skip
    elif pre in PRE_SPLITS:
        split = PRE_SPLITS[pre]
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])  # fmt: skip
    else:
        raise GGUFError(f"unsupported tokenizer.ggml.pre {pre!r} (byte-level BPE): pagemill knows "
                        f"{', '.join(sorted([*PRE_SPLITS, *DIGIT_PRE]))}")  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges that rebuild each piece from two pieces, the piece with the highest `rank`
    first (ties: shorter left, then shorter right part; within a piece by the parts' ids)."""
    merges: list[tuple[str, str, float]] = []
    for piece, score in rank.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges += local
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def sentencepiece(tokens: list[str], scores: list[float], arch: str, unk: str | None) -> Tokenizer:
    gemma = arch.startswith("gemma")
    if gemma:  # runs of spaces are stored as spaces; Gemma's merges (and pieces) spell them as ▁
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {t: -i for i, t in enumerate(tokens)} if gemma else dict(zip(tokens, scores))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(vocab, rank), fuse_unk=True, byte_fallback=True,
                               unk_token=unk if unk in vocab else None))  # fmt: skip
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    elif arch == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        decode.append(decoders.Strip(content=" ", left=1))
    else:  # Llama 2, Mistral: a space before the first word
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
        decode.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(decode)
    return tok
