"""Synthetic workloads: nothing is downloaded, everything follows from a seed.

- random: every prompt has exactly input_len tokens (+-range_ratio), output
  lengths are drawn uniformly from [output_min, output_max]; the server is
  asked to ignore EOS so each request generates exactly its output length.
- sharegpt: lengths drawn from log-normal distributions shaped like the
  ShareGPT conversations vLLM benchmarks with (long right tails: medians
  of ~200 prompt / ~150 output tokens in vLLM's sample, scaled here by the
  `median` arguments), clipped to [4, max]. Text is made of words from a
  fixed list. Outputs also ignore EOS, so the drawn length is what runs.
- prefix: `groups` shared system prompts of prefix_len tokens, each followed
  by a unique question of suffix_len tokens (the radix/prefix-cache case).

Prompt text is built from token ids and re-encoded with the served model's
tokenizer, so prompt_len is the number of tokens the server really sees.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tokenizers import Tokenizer

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter mother"
).split()


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int


class PromptMaker:
    """Text of a given token length, from the served model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, rng: random.Random) -> None:
        self.tok, self.rng = tokenizer, rng

    def text(self, n_tokens: int) -> tuple[str, int]:
        words = " ".join(self.rng.choice(WORDS) for _ in range(n_tokens + 8))
        ids = self.tok.encode(words, add_special_tokens=False).ids[:n_tokens]
        text = self.tok.decode(ids)
        return text, len(self.tok.encode(text, add_special_tokens=False).ids)


def random_dataset(tok: Tokenizer, n: int, input_len: int, output_min: int, output_max: int,
                   range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:  # fmt: skip
    lo, hi = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    return uniform_dataset(tok, n, lo, hi, output_min, output_max, seed)


def uniform_dataset(tok: Tokenizer, n: int, input_min: int, input_max: int, output_min: int, output_max: int,
                    seed: int = 0) -> list[SampleRequest]:  # fmt: skip
    """Prompt and output lengths each drawn uniformly from their [min, max]."""
    rng = random.Random(seed)
    maker = PromptMaker(tok, rng)
    out = []
    for _ in range(n):
        text, plen = maker.text(rng.randint(input_min, input_max))
        out.append(SampleRequest(text, plen, rng.randint(output_min, output_max)))
    return out


def sharegpt_like(tok: Tokenizer, n: int, input_median: int = 200, output_median: int = 150,
                  max_input: int = 1024, max_output: int = 512, seed: int = 0) -> list[SampleRequest]:  # fmt: skip
    """Log-normal lengths: ln L ~ N(ln median, sigma) with sigma 0.9 (input) and 0.8 (output)."""
    rng = random.Random(seed)
    maker = PromptMaker(tok, rng)

    def draw(median: int, sigma: float, cap: int) -> int:
        return int(min(cap, max(4, round(math.exp(rng.gauss(math.log(median), sigma))))))

    out = []
    for _ in range(n):
        text, plen = maker.text(draw(input_median, 0.9, max_input))
        out.append(SampleRequest(text, plen, draw(output_median, 0.8, max_output)))
    return out


def shared_prefix(tok: Tokenizer, n: int, groups: int = 4, prefix_len: int = 256, suffix_len: int = 32,
                  output_len: int = 64, seed: int = 0) -> list[SampleRequest]:  # fmt: skip
    """Request i uses system prompt i % groups; requests are interleaved across groups."""
    rng = random.Random(seed)
    maker = PromptMaker(tok, rng)
    prefixes = [maker.text(prefix_len)[0] for _ in range(groups)]
    out = []
    for i in range(n):
        text = prefixes[i % groups] + "\n" + maker.text(suffix_len)[0]
        out.append(SampleRequest(text, len(tok.encode(text, add_special_tokens=False).ids), output_len))
    return out


def make_dataset(name: str, tok: Tokenizer, n: int, a) -> list[SampleRequest]:
    """`a`: the parsed bench arguments (see bench/cli.py)."""
    if name == "random":
        return random_dataset(tok, n, a.random_input_len, a.random_output_min, a.random_output_max,
                              a.random_range_ratio, a.seed)  # fmt: skip
    if name == "sharegpt":
        return sharegpt_like(tok, n, a.sharegpt_input_median, a.sharegpt_output_median,
                             a.sharegpt_max_input, a.sharegpt_max_output, a.seed)  # fmt: skip
    if name == "prefix":
        return shared_prefix(tok, n, a.prefix_groups, a.prefix_len, a.prefix_suffix_len, a.prefix_output_len, a.seed)
    raise ValueError(f"unknown dataset {name!r}")
