"""ModelRunner: model + KV pool + attention backend + sampler, one Step at a time.

The runner holds every request's state between steps (shard/requests.py),
keyed by the router's ids, and computes what each Step schedules in one
forward. A request finishes here on EOS (unless ignore_eos_token; a
constrained request always ends on the EOS its finished grammar forces), a
stop token or when it has generated max_new_tokens; EOS wins when both hold.
A request that alone cannot go on (its grammar does not compile) is computed
with the others, then answered with Generation.error and dropped; so are
finished requests. A request whose LoRA adapter cannot be served is not
computed at all (its KV would be the base model's), only answered with the
error. Speculative steps: speculative/step.py.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import grpc
import torch

from pagemill.attention.kv_dtype import check_kv_dtype, kv_dtype_name, parse_kv_cache_dtype
from pagemill.config import ShardConfig
from pagemill.cpu_kernels.rowwise import greedy_kernel
from pagemill.models.config import ModelConfig, all_layers_window
from pagemill.models.llama import LlamaForCausalLM
from pagemill.models.loader import dtype_name
from pagemill.parallel.group import ParallelGroup
from pagemill.grammar.matcher import GrammarCompiler, GrammarMasker
from pagemill.lora.pool import AdapterPool
from pagemill.proto import pb
from pagemill.sampling.sampler import Sampler
from pagemill.shard.adapters import attach_adapters, enable_adapters
from pagemill.shard.constraints import banned_tokens, compile_grammar, start_masks, wait_masks
from pagemill.shard.cuda_graphs import DecodeGraphs, capture_decode_graphs
from pagemill.shard.errors import ShardError
from pagemill.shard.generations import Emitted, advance
from pagemill.shard.prompt_logprobs import prompt_logprobs, prompt_rows
from pagemill.shard.requests import Entry, Limits, RequestState, apply_step, check_step
from pagemill.shard.step_inputs import build_inputs, is_decode_step
from pagemill.shard.threads import ThreadChoice, thread_counts
from pagemill.shard.kv_pool import KVPool
from pagemill.shard.kv_tier import TierOptions, TierResult, open_tier, run_ops
from pagemill.shard.warmup import PoolWarmup
from pagemill.speculative.draft import DraftProposer
from pagemill.speculative.step import SpeculativeStep

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    generations: list  # pb.Generation
    forward_ns: int
    tier: TierResult | None = None


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
        cpu_kernels: bool = False,
        kv_offload: TierOptions = TierOptions(),
        adaptive_threads: bool = False,
        huge_pages: bool = False,
    ) -> None:
        """cpu_kernels: sample plain greedy batches with the compiled kernel (cpu_kernels/csrc/rowwise/greedy.cpp).
        adaptive_threads: run small fused CPU decode steps with all threads or one, whichever
        measures faster (shard/threads.py). huge_pages: a CPU KV pool in huge pages (models/huge_pages.py)."""
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
        greedy = greedy_kernel() if cpu_kernels and self.device.type == "cpu" else None
        self.sampler = Sampler(self.device, seed=self.group.shared_seed(), greedy=greedy)
        self.eos_ids = frozenset(config.eos_token_ids)
        self.window = all_layers_window(config)  # every step's Limits reads it
        self.pool: KVPool | None = None
        self.kv_offload = kv_offload
        self.huge_pages = huge_pages
        self.store = None  # the second KV tier, opened at warmup over the pool's layout
        self.requests: dict[int, RequestState] = {}  # what the shard holds per request id, between steps
        self.kv_dtype = parse_kv_cache_dtype(kv_cache_dtype, self.dtype)  # the pool's storage dtype
        check_kv_dtype(self.kv_dtype, model.backend.name, self.device)
        # Decode graphs only on CUDA and without speculation (verification is a varlen prefill).
        # Not for transformers' modeling code: nothing says its forward is capturable (models/impl.py).
        self.use_cuda_graphs = cuda_graphs and self.device.type == "cuda" and speculate == 0 and model.impl == "native"
        self.cuda_graphs: DecodeGraphs | None = None  # captured at warmup
        self.broken: str | None = None  # set when a forward failed unexpectedly
        self.speculate, self.draft = speculate, draft
        if draft is not None and draft.config.vocab_size != config.vocab_size:
            raise ValueError(
                f"draft model vocab_size {draft.config.vocab_size} != target vocab_size {config.vocab_size}: "
                "the draft must share the target's tokenizer"
            )
        self.model_dir = model_dir  # the KV tier namespace reads its files
        self.grammars = GrammarCompiler(model_dir, config.vocab_size, config.eos_token_ids)
        self.masker = GrammarMasker(config.vocab_size, self.device)
        self.speculative = SpeculativeStep(speculate, draft, model, self.sampler, self.masker, self.eos_ids,
                                           block_size, self.device)  # fmt: skip
        self.adaptive_threads = adaptive_threads and self.device.type == "cpu" and self.world_size == 1
        # Per batch size (the step time grows with it), made on its first eligible step.
        self.thread_choices: dict[int, ThreadChoice] = {}
        # LoRA adapters: none until a Warmup sizes the pool (shard/adapters.py); it never loads any.
        self.adapters = AdapterPool(0, 0, lambda *a: None)

    @classmethod
    def from_shard_config(cls, cfg: ShardConfig, group: ParallelGroup | None = None) -> "ModelRunner":
        """group: the tensor-parallel group of cfg.rank (None: a single unsharded shard)."""
        from pagemill.shard.runner_build import runner_kwargs

        model, config, kwargs = runner_kwargs(cfg, group)
        return cls(model, config, **kwargs)

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
            model_impl=self.model.impl,
            speculate=self.speculate,
            kv_cache_dtype=kv_dtype_name(self.kv_dtype),
            sliding_window=all_layers_window(self.config),
        )

    def check_not_broken(self) -> None:
        if self.broken is not None:
            raise ShardError(grpc.StatusCode.UNAVAILABLE, f"shard is broken: {self.broken}")

    def health(self) -> None:
        self.check_not_broken()
        # A tiny op that fails if the device is gone (e.g. a CUDA error poisoned the context).
        torch.ones(1, device=self.device).add_(1).cpu()

    # --- warmup ----------------------------------------------------------------------

    def warmup(self, req) -> "pb.WarmupResponse":
        """The Warmup RPC: the KV pool from the memory budget, the dummy steps (CPU) or decode graphs
        (CUDA), the second KV tier. A second warmup replaces the pool and forgets every request."""
        self.pool = None
        self.requests.clear()  # their KV lived in the pool being replaced
        self.cuda_graphs = None  # graphs bake in the old pool's address
        start = time.perf_counter_ns()
        with self._on_device():
            warm = PoolWarmup(self.model, self.config, self.sampler, self.draft, self.speculate, self.block_size,
                              self.kv_dtype, self.device, self.huge_pages)  # fmt: skip
            self.adapters, reserve = enable_adapters(self, req)
            self.pool = warm.run(req, self.kv_cache_memory, self.gpu_memory_utilization, reserve)
            self.cuda_graphs = capture_decode_graphs(self, req)
            elapsed = time.perf_counter_ns() - start
            log.info("warmup: %d KV blocks of %d tokens (%s), %.2fs", self.pool.num_blocks, self.block_size,
                     kv_dtype_name(self.kv_dtype), elapsed / 1e9)  # fmt: skip
            resp = pb.WarmupResponse(num_blocks=self.pool.num_blocks, block_size=self.block_size, warmup_ns=elapsed)
            if self.kv_offload.enabled:
                self.store, info = open_tier(self, req)
                resp.kv_tier.CopyFrom(info)
            return resp

    # --- steps -----------------------------------------------------------------------

    def step(self, req) -> StepResult:
        """One StepRequest: check it all (a rejected call changes nothing), drop what the
        router ended, compute every consistent entry in one forward, sample where a range
        reaches the end of the known tokens. One Generation per entry, in order."""
        pool = self._require_pool()
        lim = Limits(self.block_size, pool.num_blocks, self.config.vocab_size, self.device, self.window)
        entries = check_step(req, self.requests, lim)
        for e, s in zip(entries, req.requests):
            if e.fresh:
                compile_grammar(self.grammars, e.state, s.new_request)
        apply_step(req, entries, self.requests)
        no_adapter = attach_adapters(self.adapters, entries, req, self.requests, self.group)
        # Before the forward: a saved block may be rewritten by this very step.
        tier = run_ops(self.store, pool, req) if self.store is not None else None
        start = time.perf_counter_ns()
        # A request whose adapter failed is not computed: its KV would be the base model's.
        live = [e for e in entries if e.state is not None and e.id not in no_adapter]
        emitted, prompt_lps = {}, {}
        if live:
            choice = self._thread_choice(live)
            threads = choice.pick() if choice is not None else 0
            configured = torch.get_num_threads()
            if threads and threads != configured:
                torch.set_num_threads(threads)
            try:
                with self._guard():
                    emitted, prompt_lps = self._compute(live)
            finally:
                if threads and threads != configured:
                    torch.set_num_threads(configured)
            if choice is not None:
                choice.record(threads, time.perf_counter_ns() - start)
        generations = []
        for e in entries:
            gen, keep = advance(e, emitted.get(e.id), prompt_lps.get(e.id), self.eos_ids)
            if not keep:
                self.requests.pop(e.id, None)
            generations.append(gen)
        return StepResult(generations, time.perf_counter_ns() - start, tier)

    def _thread_choice(self, live: list[Entry]) -> ThreadChoice | None:
        """The thread-count chooser where this step is a small fused decode, else None."""
        if not self.adaptive_threads or self.speculate:
            return None
        fused = getattr(getattr(self.model, "model", None), "fused", None)
        if fused is None or self.kv_dtype != fused.dtype or len(live) > fused.max_small_batch or not is_decode_step(live):
            return None
        if any(e.state.adapter is not None for e in live):  # the per-op path: not what the choice measures
            return None
        choice = self.thread_choices.get(len(live))
        if choice is None:
            choice = self.thread_choices[len(live)] = ThreadChoice(thread_counts(torch.get_num_threads()))
        return choice if len(choice.counts) > 1 else None

    def _compute(self, live: list[Entry]) -> tuple[dict[int, Emitted], dict]:
        """Emitted tokens of the sampled entries and prompt logprobs (pb.PromptLogprobs), by request id."""
        # Proposals only in steps of decode entries alone: a prompt chunk makes it a varlen
        # forward anyway, and keeping verification to one shape keeps it simple.
        all_decode = all(e.is_decode for e in live)
        ks = [min(e.max_proposals, self.speculative.num_proposals(e.state)) if all_decode else 0 for e in live]
        if any(ks):
            proposals, draft_q = self.speculative.propose([e.state for e in live], ks)
            for e, p in zip(live, proposals):
                e.proposals = p
            if any(proposals):
                tokens = self.speculative.verify(live, draft_q, self.pool.kv_caches)
                if self.draft is not None:
                    for e, k, em in zip(live, ks, tokens):
                        if k > 0:  # the draft fed start .. start + k - 1; the first len(em) of them stand
                            e.state.draft_len = e.start + min(k, len(em.ids))
                return {e.id: em for e, em in zip(live, tokens)}, prompt_logprobs(self.model, live, None)
        inputs = build_inputs(live, self.block_size, self.device)
        sampled = [i for i, e in enumerate(live) if e.sampled]
        reqs = [live[i].state for i in sampled]
        masks = start_masks(self.masker, reqs)
        hidden = None
        if is_decode_step(live):
            # A one-token prompt chunk that predicts a prompt token needs its hidden row: no graph.
            # Nor for adapter rows: the graphs were captured without them.
            graphs = self.cuda_graphs if inputs.lora is None and not any(prompt_rows(e) for e in live) else None
            logits = graphs.logits_for(inputs) if graphs is not None else None
            if logits is None:  # no graphs (CPU, --no-cuda-graphs) or wider than the largest graph
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.pool.kv_caches,
                                    lora=inputs.lora)  # fmt: skip
                logits = self.model.head_logits(hidden)  # the sampler widens what it reads
            logits = logits[sampled] if len(sampled) < len(live) else logits
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.pool.kv_caches, lora=inputs.lora)
            if self.draft is not None:  # keeps the draft pool a mirror of every computed prompt token
                self.draft.forward(inputs.input_ids, inputs.positions, inputs.meta)
                for e in live:
                    e.state.draft_len = e.end
            logits = self.model.head_logits(hidden[inputs.last_rows[sampled]])
        if not sampled:
            wait_masks(masks)
            return {}, prompt_logprobs(self.model, live, hidden)
        out = self.sampler(logits, reqs, wait_masks(masks), banned_tokens(self.eos_ids, reqs))
        emitted = {live[i].id: Emitted([t], [lp], [(ti, tl)]) for i, t, lp, ti, tl in
                   zip(sampled, out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)}  # fmt: skip
        return emitted, prompt_logprobs(self.model, live, hidden)

    def _require_pool(self) -> KVPool:
        if self.pool is None:
            raise ShardError(grpc.StatusCode.FAILED_PRECONDITION, "Warmup must be called before Step")
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
