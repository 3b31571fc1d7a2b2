"""ModelRunner: model + KV pool + attention backend + sampler, one step at a time.

The runner computes and reports; the service owns the cached batches. A
request finishes here on EOS (unless ignore_eos_token; a constrained request
always ends on the EOS its finished grammar forces) or when it has generated
max_new_tokens; EOS wins when both hold. A request that alone cannot go on
(its grammar does not compile) is computed with the others, then answered
with Generation.error and dropped. Finished requests are removed from the
batch the runner was given.

With speculate = K > 0 each decode step proposes up to K tokens per request
(n-gram lookup or a draft model), verifies them in one target forward and
returns the accepted ones plus one (speculative/verify.py). Requests with
penalties, a grammar or EOS still banned (min_new_tokens) get no proposals:
their next-token distribution depends on the tokens before it in ways the
batched verifier does not model.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Sequence

import grpc
import torch

from pagemill.attention.backend import select_backend
from pagemill.attention.kv_dtype import check_kv_dtype, kv_dtype_name, parse_kv_cache_dtype
from pagemill.config import ShardConfig
from pagemill.models.config import ModelConfig
from pagemill.models.llama import LlamaForCausalLM
from pagemill.models.auto_dtype import resolve_dtype
from pagemill.models.loader import dtype_name, load_model, parse_dtype
from pagemill.parallel.group import ParallelGroup
from pagemill.grammar.matcher import GrammarCompiler, GrammarError, GrammarMasker
from pagemill.proto import pb
from pagemill.sampling.sampler import Sampler
from pagemill.shard.batch import RequestState, ShardBatch
from pagemill.shard.cuda_graphs import DecodeGraphs, capture_decode_graphs
from pagemill.shard.errors import ShardError
from pagemill.shard.generations import Emitted, advance
from pagemill.shard.kv_pool import KVPool
from pagemill.shard.warmup import allocate_pools, cuda_budget, dummy_steps
from pagemill.speculative.draft import DraftProposer
from pagemill.speculative.ngram import propose_ngram
from pagemill.speculative.verify import verify

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    generations: list  # pb.Generation
    forward_ns: int


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        *,
        device: torch.device | str = "cpu",
        block_size: int = 16,
        kv_cache_memory: int = 1 << 30,
        gpu_memory_utilization: float = 0.9,
        model_id: str = "",
        model_dir: str | None = None,
        speculate: int = 0,
        draft: DraftProposer | None = None,
        cuda_graphs: bool = True,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model, self.config = model, config
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.kv_cache_memory = kv_cache_memory
        self.gpu_memory_utilization = gpu_memory_utilization
        # Tensor parallelism: the model's group; ranks compute the same steps in lockstep.
        self.group = model.group
        self.model_id, self.rank, self.world_size = model_id, self.group.rank, self.group.world_size
        # All ranks draw unseeded requests from one shared seed, so they sample alike.
        self.sampler = Sampler(self.device, seed=self.group.shared_seed())
        self.eos_ids = frozenset(config.eos_token_ids)
        self.pool: KVPool | None = None
        self.kv_dtype = parse_kv_cache_dtype(kv_cache_dtype, self.dtype)  # the pool's storage dtype
        check_kv_dtype(self.kv_dtype, model.backend.name, self.device)
        # Decode graphs only on CUDA and without speculation (verification is a varlen prefill).
        self.use_cuda_graphs = cuda_graphs and self.device.type == "cuda" and speculate == 0
        self.cuda_graphs: DecodeGraphs | None = None  # captured at warmup
        self.broken: str | None = None  # set when a forward failed unexpectedly
        if speculate < 0:
            raise ValueError(f"speculate must be >= 0, got {speculate}")
        self.speculate, self.draft = speculate, draft
        if draft is not None and draft.config.vocab_size != config.vocab_size:
            raise ValueError(
                f"draft model vocab_size {draft.config.vocab_size} != target vocab_size {config.vocab_size}: "
                "the draft must share the target's tokenizer"
            )
        self.grammars = GrammarCompiler(model_dir, config.vocab_size, config.eos_token_ids)
        self.masker = GrammarMasker(config.vocab_size, self.device)

    @classmethod
    def from_shard_config(cls, cfg: ShardConfig, group: ParallelGroup | None = None) -> "ModelRunner":
        """group: the tensor-parallel group of cfg.rank (None: a single unsharded shard)."""
        group = group or ParallelGroup.single(cfg.device)
        device = group.device  # with several CUDA ranks: this rank's GPU
        backend = select_backend(cfg.attention, device, cpu_kernels=cfg.cpu_kernels)
        dtype, why = resolve_dtype(cfg.dtype, device)
        log.info("dtype %s (%s)", dtype, why)
        model, config = load_model(cfg.model_dir, parse_dtype(dtype), device, backend, group,
                                   cpu_kernels=cfg.cpu_kernels, quantize=cfg.quantize)
        draft = None
        if cfg.speculate > 0 and cfg.speculate_method == "draft":
            if not cfg.draft_model:
                raise ValueError("--speculate-method draft needs --draft-model DIR")
            # The draft is small: every rank runs all of it (replicated, no
            # communication), fed the same inputs and sampler, so proposals agree.
            d_model, d_config = load_model(cfg.draft_model, parse_dtype(dtype), device, backend,
                                           cpu_kernels=cfg.cpu_kernels)
            draft = DraftProposer(d_model, d_config, device, cfg.block_size)
        return cls(
            model,
            config,
            device=device,
            block_size=cfg.block_size,
            kv_cache_memory=cfg.kv_cache_memory,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            model_id=os.path.basename(os.path.normpath(cfg.model_dir)),
            model_dir=cfg.model_dir,
            speculate=cfg.speculate,
            draft=draft,
            cuda_graphs=cfg.cuda_graphs,
            kv_cache_dtype=cfg.kv_cache_dtype,
        )

    # --- static facts and liveness -------------------------------------------------

    def info(self):
        return pb.InfoResponse(
            model_id=self.model_id,
            dtype=dtype_name(self.dtype),
            device_type=self.device.type,
            block_size=self.block_size,
            vocab_size=self.config.vocab_size,
            max_position_embeddings=self.config.max_position_embeddings,
            eos_token_ids=list(self.config.eos_token_ids),
            rank=self.rank,
            world_size=self.world_size,
            attention_backend=self.model.backend.name,
            speculate=self.speculate,
            kv_cache_dtype=kv_dtype_name(self.kv_dtype),
        )

    def health(self) -> None:
        if self.broken is not None:
            raise ShardError(grpc.StatusCode.UNAVAILABLE, f"shard is broken: {self.broken}")
        # A tiny op that fails if the device is gone (e.g. a CUDA error poisoned the context).
        torch.ones(1, device=self.device).add_(1).cpu()

    # --- warmup ----------------------------------------------------------------------

    def warmup(self, req) -> "pb.WarmupResponse":
        with self._on_device():
            return self._warmup(req)

    def _warmup(self, req) -> "pb.WarmupResponse":
        if req.max_batch_prefill_tokens == 0 or req.max_input_tokens == 0:
            raise ShardError(
                grpc.StatusCode.INVALID_ARGUMENT, "max_batch_prefill_tokens and max_input_tokens must be > 0"
            )
        self.pool = None  # a second warmup replaces the pool (the service drops cached batches)
        self.cuda_graphs = None  # graphs bake in the old pool's address
        start = time.perf_counter_ns()
        try:
            budget = cuda_budget(self, req) if self.device.type == "cuda" else self.kv_cache_memory
            allocate_pools(self, budget)
        except ValueError as e:  # the budget holds fewer than 2 blocks
            self.pool = None
            raise ShardError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        if self.device.type != "cuda":
            dummy_steps(self, req)
        elapsed = time.perf_counter_ns() - start
        needed = math.ceil(req.max_total_tokens / self.block_size) + 1
        if self.pool.num_blocks < needed:
            num_blocks, self.pool = self.pool.num_blocks, None
            raise ShardError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"KV pool holds {num_blocks} blocks of {self.block_size} tokens; one request of "
                f"max_total_tokens={req.max_total_tokens} needs {needed} (scratch block included). "
                "Give the KV cache more memory or lower max_total_tokens.",
            )
        self.cuda_graphs = capture_decode_graphs(self, req)
        elapsed = time.perf_counter_ns() - start
        log.info("warmup: %d KV blocks of %d tokens (%s), %.2fs", self.pool.num_blocks, self.block_size,
                 kv_dtype_name(self.kv_dtype), elapsed / 1e9)  # fmt: skip
        return pb.WarmupResponse(num_blocks=self.pool.num_blocks, block_size=self.block_size, warmup_ns=elapsed)

    # --- steps -----------------------------------------------------------------------

    def new_batch(self, batch) -> ShardBatch:
        pool = self._require_pool()
        out = ShardBatch.from_pb(
            batch, block_size=self.block_size, num_blocks=pool.num_blocks, vocab_size=self.config.vocab_size,
            device=self.device,
        )  # fmt: skip
        for r, req in zip(out.requests, batch.requests):
            if req.HasField("grammar"):
                try:
                    r.grammar = self.grammars.compile(req.grammar)
                except GrammarError as e:
                    r.error = str(e)  # the request is still computed (forks may read its KV), then dropped
                    continue
                if r.grammar is not None:  # after a preemption: replay what was generated before
                    r.error = r.grammar.consume(r.token_ids[r.prompt_len :])
        return out

    def prefill(self, batch: ShardBatch) -> StepResult:
        self._require_pool()
        inputs = batch.prefill_inputs(self.device)
        start = time.perf_counter_ns()
        with self._guard():
            masks = self._start_masks(batch.requests)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.pool.kv_caches)
            if self.draft is not None:
                self.draft.forward(inputs.input_ids, inputs.positions, inputs.meta)
            out = self.sampler(self.model.compute_logits(hidden[inputs.last_rows]), batch.requests, self._wait(masks),
                               self.banned_tokens(batch.requests))
            prompt_lps = self._prompt_logprobs(batch, hidden)
        emitted = [Emitted([t], [lp], [(i, l)]) for t, lp, i, l in
                   zip(out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)]  # fmt: skip
        if self.draft is not None:
            for r in batch.requests:
                r.draft_len = r.seq_len
        return StepResult(advance(batch, emitted, prompt_lps, self.eos_ids), time.perf_counter_ns() - start)

    def decode(self, batch: ShardBatch, slots: Sequence) -> StepResult:
        pool = self._require_pool()
        slots = batch.assign_decode_slots(
            slots, block_size=self.block_size, num_blocks=pool.num_blocks, speculate=self.speculate
        )
        start = time.perf_counter_ns()
        with self._guard():
            ks = [self._num_proposals(r) for r in batch.requests]
            proposals, draft_q = self._propose(batch.requests, ks)
            if any(proposals):
                emitted = self._verify(batch, proposals, draft_q, slots)
            else:
                emitted = self._plain_decode(batch, [s[0] for s in slots])
        if self.draft is not None:
            for r, k, e in zip(batch.requests, ks, emitted):
                if k > 0:  # the draft fed seq_len - 1 .. seq_len - 2 + k; the first len(e) of them stand
                    r.draft_len = r.seq_len - 1 + min(k, len(e.ids))
        return StepResult(advance(batch, emitted, {}, self.eos_ids), time.perf_counter_ns() - start)

    def _plain_decode(self, batch: ShardBatch, slots: list[int]) -> list[Emitted]:
        inputs = batch.decode_inputs(slots, self.device)
        masks = self._start_masks(batch.requests)
        logits = self.cuda_graphs.logits_for(inputs) if self.cuda_graphs is not None else None
        if logits is None:  # no graphs (CPU, --no-cuda-graphs) or wider than the largest graph
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.pool.kv_caches)
            logits = self.model.compute_logits(hidden)
        out = self.sampler(logits, batch.requests, self._wait(masks), self.banned_tokens(batch.requests))
        return [Emitted([t], [lp], [(i, l)]) for t, lp, i, l in
                zip(out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)]  # fmt: skip

    def _num_proposals(self, r: RequestState) -> int:
        """K where exactness is cheap; the bonus token always comes on top, so at most
        max_new_tokens - generated - 1 proposals can ever be used."""
        if (self.speculate == 0 or r.params.has_penalties or r.grammar is not None or r.error is not None
                or r.generated < r.min_new_tokens):
            return 0
        return max(0, min(self.speculate, r.max_new_tokens - r.generated - 1))

    def _propose(self, requests: Sequence[RequestState], ks: list[int]):
        if not any(ks):
            return [[] for _ in requests], None
        if self.draft is not None:
            return self.draft.propose(self.sampler, requests, ks)
        return [propose_ngram(r.token_ids, k) for r, k in zip(requests, ks)], None

    def _verify(self, batch: ShardBatch, proposals, draft_q, slots) -> list[Emitted]:
        reqs = batch.requests
        inputs = batch.verify_inputs(proposals, slots, self.device)
        counts = [1 + len(p) for p in proposals]
        rows = [r for r, c in zip(reqs, counts) for _ in range(c)]  # one row per fed position
        offsets = [0, *itertools.accumulate(counts)][:-1]
        # Requests with a grammar have no proposals: one row each, at their offset.
        masks = self._start_masks(reqs, offsets)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.pool.kv_caches)
        shaped = self.sampler.shape(self.model.compute_logits(hidden), rows, self._wait(masks),
                                    self.banned_tokens(reqs, offsets))
        tokens = verify(self.sampler, self.sampler.target_probs(shaped, rows), counts, proposals, reqs, draft_q)
        # Each row's chosen token, for its logprob (rows past a rejection report a dummy 0).
        ids = [t for toks, c in zip(tokens, counts) for t in toks + [0] * (c - len(toks))]
        out = self.sampler.report(torch.tensor(ids, device=self.device), shaped, rows)
        return [
            Emitted(toks, out.logprobs[off : off + len(toks)],
                    list(zip(out.top_ids[off : off + len(toks)], out.top_logprobs[off : off + len(toks)])))
            for off, toks in zip(offsets, tokens)
        ]  # fmt: skip

    def banned_tokens(self, requests: Sequence[RequestState], rows: Sequence[int] | None = None) -> dict:
        """Row -> tokens it may not draw: EOS and the stop tokens while a request has
        generated fewer than min_new_tokens (such requests have no proposals: one row each)."""
        return {
            i if rows is None else rows[i]: sorted(self.eos_ids | r.stop_token_ids)
            for i, r in enumerate(requests)
            if r.generated < r.min_new_tokens
        }

    def _start_masks(self, requests: Sequence[RequestState], rows: Sequence[int] | None = None):
        """Starts the grammar masks of constrained rows; they compute while the forward runs."""
        pairs = []
        for i, r in enumerate(requests):
            if r.grammar is not None and r.error is None:
                r.error = r.grammar.error
                if r.error is None:
                    pairs.append((i if rows is None else rows[i], r.grammar))
        return self.masker.start(pairs)

    @staticmethod
    def _wait(masks):
        return masks.result() if masks is not None else None

    def _require_pool(self) -> KVPool:
        if self.pool is None:
            raise ShardError(grpc.StatusCode.FAILED_PRECONDITION, "Warmup must be called before Prefill/Decode")
        return self.pool

    def _on_device(self):
        """Makes this shard's GPU current for the calling thread. The service runs model
        calls in worker threads, whose current device is cuda:0 whatever the main thread
        set; kernels launched on the current device's stream (Triton) and NCCL need the
        rank's own GPU (cuda:1.. under tensor parallelism)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    @contextmanager
    def _guard(self):
        # A failure inside the forward is a bug or a device fault, not bad
        # input (that was rejected earlier): report it and fail Health.
        try:
            with torch.inference_mode(), self._on_device():
                yield
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            log.exception("forward failed")
            raise

    def _prompt_logprobs(self, batch: ShardBatch, hidden: torch.Tensor) -> dict[int, list[float]]:
        """Raw-logit log_softmax of each prompt token given its prefix (TGI's
        decoder_input_details). NaN for the first token and for tokens whose
        predecessor was cached (its logits were not computed this step)."""
        result: dict[int, list[float]] = {}
        row = 0
        for r in batch.requests:
            n_new = r.seq_len - r.cache_len
            if r.prefill_logprobs:
                lps = [math.nan] * (r.cache_len + 1)
                if n_new > 1:
                    logits = self.model.compute_logits(hidden[row : row + n_new - 1])
                    targets = torch.tensor(r.token_ids[r.cache_len + 1 :], device=logits.device)
                    lps += logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1).tolist()
                result[r.id] = lps
            row += n_new
        return result
