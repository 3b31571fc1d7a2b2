"""What constrains a request's next token besides its sampling parameters: its grammar (a
mask computed beside the forward) and the tokens it may not draw yet (EOS and stop tokens
before min_new_tokens). Used by the runner's step and by speculative verification alike."""

from __future__ import annotations

from typing import Sequence

from pagemill.grammar.matcher import GrammarCompiler, GrammarError, GrammarMasker
from pagemill.shard.requests import RequestState


def compile_grammar(grammars: GrammarCompiler, r: RequestState, new) -> None:
    """r's grammar from its NewRequest, if it has one; a grammar that does not compile becomes
    r.error (the request is still computed, as forks may read its KV, then dropped)."""
    if not new.HasField("grammar"):
        return
    try:
        r.grammar = grammars.compile(new.grammar)
    except GrammarError as e:
        r.error = str(e)
        return
    if r.grammar is not None:  # after a preemption: replay what was generated before
        r.error = r.grammar.consume(r.token_ids[r.prompt_len :])


def start_masks(masker: GrammarMasker, requests: Sequence[RequestState], rows: Sequence[int] | None = None):
    """Starts the grammar masks of constrained rows (request i's at rows[i], else i); they
    compute while the forward runs. wait_masks() collects them."""
    pairs = []
    for i, r in enumerate(requests):
        if r.grammar is not None and r.error is None:
            r.error = r.grammar.error
            if r.error is None:
                pairs.append((i if rows is None else rows[i], r.grammar))
    return masker.start(pairs)


def wait_masks(masks):
    return masks.result() if masks is not None else None


def banned_tokens(eos_ids: set[int], requests: Sequence[RequestState], rows: Sequence[int] | None = None) -> dict:
    """Row -> tokens it may not draw: EOS and the stop tokens while a request has
    generated fewer than min_new_tokens (such requests have no proposals: one row each)."""
    return {
        i if rows is None else rows[i]: sorted(eos_ids | r.stop_token_ids)
        for i, r in enumerate(requests)
        if r.generated < r.min_new_tokens
    }
