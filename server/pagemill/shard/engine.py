"""ModelRunner: model + KV pool + attention backend + sampler, one step at a time.

The runner computes and reports; the service owns the cached batches. A
request finishes here on EOS (unless ignore_eos_token) or when it has
generated max_new_tokens; EOS wins when both hold. Finished requests are
removed from the batch the runner was given.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Sequence

import grpc
import torch

from pagemill.attention.backend import select_backend
from pagemill.attention.metadata import make_metadata
from pagemill.config import ShardConfig
from pagemill.models.config import ModelConfig
from pagemill.models.llama import LlamaForCausalLM
from pagemill.models.loader import dtype_name, load_model, parse_dtype
from pagemill.proto import pb
from pagemill.sampling.params import SamplingParams
from pagemill.sampling.sampler import Sampler, SamplerOutput
from pagemill.shard.batch import RequestState, ShardBatch, StepInputs
from pagemill.shard.errors import ShardError
from pagemill.shard.kv_pool import SCRATCH_BLOCK, KVPool

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    generations: list  # pb.Generation
    forward_ns: int


@dataclass
class _WarmupRow:  # a SamplingRow for the dummy decode of warmup
    params: SamplingParams
    generator: None = None
    token_ids: tuple = (0,)
    prompt_len: int = 1
    top_n: int = 0


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
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.model, self.config = model, config
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.kv_cache_memory = kv_cache_memory
        self.gpu_memory_utilization = gpu_memory_utilization
        self.model_id, self.rank, self.world_size = model_id, rank, world_size
        self.sampler = Sampler(self.device)
        self.eos_ids = frozenset(config.eos_token_ids)
        self.pool: KVPool | None = None
        self.broken: str | None = None  # set when a forward failed unexpectedly

    @classmethod
    def from_shard_config(cls, cfg: ShardConfig) -> "ModelRunner":
        backend = select_backend(cfg.attention, cfg.device)
        model, config = load_model(cfg.model_dir, parse_dtype(cfg.dtype), cfg.device, backend)
        return cls(
            model,
            config,
            device=cfg.device,
            block_size=cfg.block_size,
            kv_cache_memory=cfg.kv_cache_memory,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            model_id=os.path.basename(os.path.normpath(cfg.model_dir)),
            rank=cfg.rank,
            world_size=cfg.world_size,
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
        )

    def health(self) -> None:
        if self.broken is not None:
            raise ShardError(grpc.StatusCode.UNAVAILABLE, f"shard is broken: {self.broken}")
        # A tiny op that fails if the device is gone (e.g. a CUDA error poisoned the context).
        torch.ones(1, device=self.device).add_(1).cpu()

    # --- warmup ----------------------------------------------------------------------

    def warmup(self, req) -> "pb.WarmupResponse":
        if req.max_batch_prefill_tokens == 0 or req.max_input_tokens == 0:
            raise ShardError(
                grpc.StatusCode.INVALID_ARGUMENT, "max_batch_prefill_tokens and max_input_tokens must be > 0"
            )
        self.pool = None  # a second warmup replaces the pool (the service drops cached batches)
        start = time.perf_counter_ns()
        try:
            if self.device.type == "cuda":
                self.pool = self._size_pool_on_cuda(req)
            else:
                self.pool = KVPool.allocate(
                    self.config, block_size=self.block_size, dtype=self.dtype, device=self.device,
                    memory_bytes=self.kv_cache_memory,
                )  # fmt: skip
        except ValueError as e:  # the budget holds fewer than 2 blocks
            self.pool = None
            raise ShardError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        if self.device.type != "cuda":
            self._dummy_steps(req)
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
        log.info("warmup: %d KV blocks of %d tokens, %.2fs", self.pool.num_blocks, self.block_size, elapsed / 1e9)
        return pb.WarmupResponse(num_blocks=self.pool.num_blocks, block_size=self.block_size, warmup_ns=elapsed)

    def _size_pool_on_cuda(self, req) -> KVPool:
        # Peak activation memory is measured with a one-block (scratch) pool,
        # then the real pool takes what is left of the utilisation budget.
        self.pool = KVPool.with_blocks(
            self.config, num_blocks=1, block_size=self.block_size, dtype=self.dtype, device=self.device
        )
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_steps(req)
        torch.cuda.synchronize(self.device)
        peak_extra = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        self.pool = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.gpu_memory_utilization) - (total - free) - peak_extra
        return KVPool.allocate(
            self.config, block_size=self.block_size, dtype=self.dtype, device=self.device, memory_bytes=max(budget, 0)
        )

    @torch.inference_mode()
    def _dummy_steps(self, req) -> None:
        """The largest prefill the router will send, then the widest decode, all in scratch block 0."""
        bs, vocab = self.block_size, self.config.vocab_size
        total, longest = req.max_batch_prefill_tokens, min(req.max_input_tokens, req.max_batch_prefill_tokens)
        lens = [longest] * (total // longest) + ([total % longest] if total % longest else [])
        meta = make_metadata(
            is_prefill=True, query_lens=lens, kv_lens=lens,
            block_tables=[[SCRATCH_BLOCK] * math.ceil(n / bs) for n in lens],
            slot_mapping=[SCRATCH_BLOCK * bs + i % bs for n in lens for i in range(n)], device=self.device,
        )  # fmt: skip
        ids = torch.arange(total, device=self.device) % vocab
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(ids, positions, meta, self.pool.kv_caches)
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1
        self.sampler(self.model.compute_logits(hidden[last]), [_WarmupRow(SamplingParams())] * len(lens))

        b = max(1, req.max_batch_size)
        meta = make_metadata(
            is_prefill=False, query_lens=[1] * b, kv_lens=[1] * b, block_tables=[[SCRATCH_BLOCK]] * b,
            slot_mapping=[SCRATCH_BLOCK * bs] * b, device=self.device,
        )  # fmt: skip
        zeros = torch.zeros(b, dtype=torch.int64, device=self.device)
        hidden = self.model(zeros, zeros, meta, self.pool.kv_caches)
        # Sampling rows exercise the sort-based warpers at full batch width.
        row = _WarmupRow(SamplingParams(temperature=0.7, top_k=50, top_p=0.9, do_sample=True))
        self.sampler(self.model.compute_logits(hidden), [row] * b)

    # --- steps -----------------------------------------------------------------------

    def new_batch(self, batch) -> ShardBatch:
        pool = self._require_pool()
        return ShardBatch.from_pb(
            batch, block_size=self.block_size, num_blocks=pool.num_blocks, vocab_size=self.config.vocab_size,
            device=self.device,
        )  # fmt: skip

    def prefill(self, batch: ShardBatch) -> StepResult:
        self._require_pool()
        return self._step(batch, batch.prefill_inputs(self.device), prefill=True)

    def decode(self, batch: ShardBatch, slots: Sequence) -> StepResult:
        pool = self._require_pool()
        new_slots = batch.assign_decode_slots(slots, block_size=self.block_size, num_blocks=pool.num_blocks)
        return self._step(batch, batch.decode_inputs(new_slots, self.device), prefill=False)

    def _require_pool(self) -> KVPool:
        if self.pool is None:
            raise ShardError(grpc.StatusCode.FAILED_PRECONDITION, "Warmup must be called before Prefill/Decode")
        return self.pool

    def _step(self, batch: ShardBatch, inputs: StepInputs, prefill: bool) -> StepResult:
        start = time.perf_counter_ns()
        try:
            with torch.inference_mode():
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.pool.kv_caches)
                out = self.sampler(self.model.compute_logits(hidden[inputs.last_rows]), batch.requests)
                prompt_lps = self._prompt_logprobs(batch, hidden) if prefill else {}
        except Exception as e:
            # A failure inside the forward is a bug or a device fault, not bad
            # input (that was rejected earlier): report it and fail Health.
            self.broken = f"{type(e).__name__}: {e}"
            log.exception("forward failed")
            raise
        forward_ns = time.perf_counter_ns() - start
        generations = self._advance(batch, out, prompt_lps)
        return StepResult(generations, forward_ns)

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

    def _advance(self, batch: ShardBatch, out: SamplerOutput, prompt_lps: dict[int, list[float]]) -> list:
        generations, alive = [], []
        for i, r in enumerate(batch.requests):
            token = out.token_ids[i]
            if r.id in prompt_lps:
                prefill_tokens = pb.Tokens(ids=r.token_ids, logprobs=prompt_lps[r.id])
            else:
                prefill_tokens = None
            r.cache_len = r.seq_len  # everything fed so far is now in the pool
            r.token_ids.append(token)
            r.generated += 1
            finish = self._finish_reason(r, token)
            generations.append(
                pb.Generation(
                    request_id=r.id,
                    prefill_tokens=prefill_tokens,
                    tokens=pb.Tokens(ids=[token], logprobs=[out.logprobs[i]]),
                    top_tokens=[pb.Tokens(ids=out.top_ids[i], logprobs=out.top_logprobs[i])] if r.top_n else [],
                    finish_reason=finish,
                )
            )
            if finish == pb.FINISH_REASON_UNSPECIFIED:
                alive.append(r)
        batch.requests = alive
        return generations

    def _finish_reason(self, r: RequestState, token: int) -> int:
        if token in self.eos_ids and not r.ignore_eos:
            return pb.FINISH_REASON_EOS_TOKEN
        if r.generated >= r.max_new_tokens:
            return pb.FINISH_REASON_LENGTH
        return pb.FINISH_REASON_UNSPECIFIED
