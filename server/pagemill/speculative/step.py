"""SpeculativeStep: how many proposals a request gets, proposing them, verifying them.

With speculate = K > 0 a step of decode entries proposes up to
min(K, max_proposals) tokens per request (n-gram lookup or a draft model),
feeds them after the decode token in one varlen target forward and returns
the accepted ones plus one (speculative/verify.py). Requests with
penalties, a grammar or EOS still banned (min_new_tokens) get no proposals:
their next-token distribution depends on the tokens before it in ways the
batched verifier does not model.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from pagemill.grammar.matcher import GrammarMasker
from pagemill.sampling.sampler import Sampler
from pagemill.shard.constraints import banned_tokens, start_masks, wait_masks
from pagemill.shard.generations import Emitted
from pagemill.shard.requests import Entry, RequestState
from pagemill.shard.step_inputs import build_inputs, fed_tokens
from pagemill.speculative.draft import DraftProposer
from pagemill.speculative.ngram import propose_ngram
from pagemill.speculative.verify import verify


class SpeculativeStep:
    """The speculative half of a shard's decode step, over the runner's model, sampler and masker."""

    def __init__(self, speculate: int, draft: DraftProposer | None, model, sampler: Sampler, masker: GrammarMasker,
                 eos_ids: frozenset[int], block_size: int, device: torch.device) -> None:  # fmt: skip
        if speculate < 0:
            raise ValueError(f"speculate must be >= 0, got {speculate}")
        self.speculate, self.draft = speculate, draft
        self.model, self.sampler, self.masker = model, sampler, masker
        self.eos_ids, self.block_size, self.device = eos_ids, block_size, device

    def num_proposals(self, r: RequestState) -> int:
        """K where exactness is cheap; the bonus token always comes on top, so at most
        max_new_tokens - generated - 1 proposals can ever be used."""
        if (self.speculate == 0 or r.params.has_penalties or r.grammar is not None or r.error is not None
                or r.generated < r.min_new_tokens):  # fmt: skip
            return 0
        return max(0, min(self.speculate, r.max_new_tokens - r.generated - 1))

    def propose(self, requests: Sequence[RequestState], ks: list[int]):
        """Up to ks[i] proposals per request, and the draft's distributions (None for n-grams)."""
        if self.draft is not None:
            return self.draft.propose(self.sampler, requests, ks)
        return [propose_ngram(r.token_ids, k) for r, k in zip(requests, ks)], None

    def verify(self, live: list[Entry], draft_q, kv_caches) -> list[Emitted]:
        """Decode token plus proposals per entry, as one varlen forward; every row's logits count."""
        reqs = [e.state for e in live]
        inputs = build_inputs(live, self.block_size, self.device)
        counts = [len(fed_tokens(e)) for e in live]
        proposals = [e.proposals for e in live]
        rows = [r for r, c in zip(reqs, counts) for _ in range(c)]  # one row per fed position
        offsets = [0, *itertools.accumulate(counts)][:-1]
        # Requests with a grammar have no proposals: one row each, at their offset.
        masks = start_masks(self.masker, reqs, offsets)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, kv_caches, lora=inputs.lora)
        shaped = self.sampler.shape(self.model.compute_logits(hidden), rows, wait_masks(masks),
                                    banned_tokens(self.eos_ids, reqs, offsets))  # fmt: skip
        tokens = verify(self.sampler, self.sampler.target_probs(shaped, rows), counts, proposals, reqs, draft_q)
        # Each row's chosen token, for its logprob (rows past a rejection report a dummy 0).
        ids = [t for toks, c in zip(tokens, counts) for t in toks + [0] * (c - len(toks))]
        out = self.sampler.report(torch.tensor(ids, device=self.device), shaped, rows)
        return [
            Emitted(toks, out.logprobs[off : off + len(toks)],
                    list(zip(out.top_ids[off : off + len(toks)], out.top_logprobs[off : off + len(toks)])))
            for off, toks in zip(offsets, tokens)
        ]  # fmt: skip
