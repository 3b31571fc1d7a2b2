"""Per-request grammar state and batched token masks, on llguidance.

llguidance (the Rust core of Guidance) needs no ahead-of-time index: a
grammar compiles in milliseconds and each mask is computed lazily from the
current parser state (tens of microseconds), with the GIL released, in
parallel across requests by an LLExecutor. That fits continuous batching:
a new constrained request never stalls the batch on an index build, and
the masks of one step are computed in a worker thread while the model's
forward runs (they depend only on tokens already consumed).

The token-level tokenizer adapter is built once per shard from the model
directory's tokenizer.json (the `tokenizers` format llguidance reads
natively), with the model's vocab size (rows past the tokenizer's vocab
are never allowed) and the model's EOS ids, which a finished grammar forces.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pagemill.proto import pb
from pagemill.sampling.sampler import GrammarMask


# Compact, fixed whitespace: `{"a": 1, "b": [2, 3]}`. Flexible whitespace lets a
# model pad forever (a known failure of small models under a JSON mask) and
# makes the token count of a bounded schema unbounded. A schema can still ask
# for other settings through llguidance's "x-guidance" key.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The request's grammar cannot be served (bad schema/regex, no tokenizer)."""


@dataclass
class GrammarState:
    matcher: object  # llguidance.LLMatcher of one request

    def consume(self, tokens: Sequence[int]) -> str | None:
        """Advances over sampled tokens; returns an error message when the matcher fails."""
        for t in tokens:
            if not self.matcher.consume_token(int(t)):
                return f"grammar rejected token {t}: {self.matcher.get_error() or 'not allowed'}"
        return None

    @property
    def finished(self) -> bool:
        """Nothing but EOS can follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() or None if self.matcher.is_error() else None


class GrammarCompiler:
    """Compiles pb.Grammar into per-request matchers; the tokenizer loads on first use."""

    def __init__(self, model_dir: str | None, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.model_dir, self.vocab_size, self.eos_ids = model_dir, vocab_size, list(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                path = os.path.join(self.model_dir or "", "tokenizer.json")
                if not os.path.isfile(path):
                    raise GrammarError(f"constrained decoding needs {path}, which does not exist")
                with open(path) as f:
                    text = f.read()
                try:
                    self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_ids)
                except Exception as e:  # an unusual tokenizer.json: this request fails, the shard goes on
                    raise GrammarError(f"cannot build the grammar tokenizer from {path}: {e}") from None
            return self._tokenizer

    def compile(self, grammar) -> GrammarState | None:
        """pb.Grammar -> state (None when unconstrained); raises GrammarError."""
        if grammar is None or grammar.type == pb.GRAMMAR_TYPE_NONE:
            return None
        import llguidance

        if grammar.type == pb.GRAMMAR_TYPE_JSON:
            value = grammar.value.strip()
            # "" and "{}" are OpenAI's json_object: any JSON object.
            schema = '{"type": "object"}' if value in ("", "{}") else value
            try:
                json.loads(schema)
                text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
            except ValueError as e:
                raise GrammarError(f"invalid JSON schema: {e}") from None
        elif grammar.type == pb.GRAMMAR_TYPE_REGEX:
            text = llguidance.LLMatcher.grammar_from_regex(grammar.value)
        elif grammar.type == pb.GRAMMAR_TYPE_LARK:
            text = llguidance.LLMatcher.grammar_from_lark(grammar.value)
        else:
            raise GrammarError(f"unknown grammar type {grammar.type}")
        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0)
        if matcher.is_error():
            kind = {pb.GRAMMAR_TYPE_JSON: "JSON schema", pb.GRAMMAR_TYPE_LARK: "grammar"}.get(grammar.type, "regex")
            raise GrammarError(f"invalid {kind}: {matcher.get_error()}")
        return GrammarState(matcher)


class GrammarMasker:
    """Computes the allowed-token masks of constrained rows, optionally in the background."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self._executor = None  # llguidance.LLExecutor, created with the first mask
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        words = (vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int32, device=self.device)
        self._words = words

    def start(self, rows: Sequence[tuple[int, GrammarState]]) -> Future | None:
        """Starts the masks of (row, state) pairs; .result() gives a GrammarMask."""
        if not rows:
            return None
        return self._pool.submit(self._compute, list(rows))

    def _compute(self, rows: list[tuple[int, GrammarState]]) -> GrammarMask:
        import llguidance
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bitmask = np.zeros((len(rows), self._words), dtype=np.int32)
        fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for i, (_, s) in enumerate(rows)], bitmask)
        packed = torch.from_numpy(bitmask).to(self.device)
        allowed = ((packed[:, :, None] >> self._bits) & 1).bool().flatten(1)[:, : self.vocab_size]
        return GrammarMask([r for r, _ in rows], allowed)
