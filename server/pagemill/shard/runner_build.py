"""What ModelRunner.from_shard_config builds from a ShardConfig: the device and block size, the
attention backend, the dtype (`auto` resolved for this CPU or GPU), the model (and a draft model
for draft speculation), and the runner's keyword arguments. Kept apart from the runner, which
only steps."""

from __future__ import annotations

import logging
import os

from pagemill.attention.backend import select_backend
from pagemill.attention.invariant_backend import BatchInvariantAttention
from pagemill.config import ShardConfig, check_batch_invariant
from pagemill.cpu_kernels.invariant import invariant_kernels
from pagemill.models.batch_invariant import Invariant, make_batch_invariant
from pagemill.models.auto_dtype import resolve_dtype
from pagemill.models.config import ModelConfig
from pagemill.models.llama import LlamaForCausalLM
from pagemill.models.loader import load_model, parse_dtype
from pagemill.parallel.group import ParallelGroup
from pagemill.shard.kv_pool import resolve_block_size
from pagemill.shard.kv_tier import TierOptions
from pagemill.speculative.draft import DraftProposer

log = logging.getLogger(__name__)


def runner_kwargs(cfg: ShardConfig, group: ParallelGroup | None) -> tuple[LlamaForCausalLM, ModelConfig, dict]:
    """The model, its config and ModelRunner's keyword arguments for cfg; group: the
    tensor-parallel group of cfg.rank (None: a single unsharded shard)."""
    group = group or ParallelGroup.single(cfg.device)
    device = group.device  # with several CUDA ranks: this rank's GPU
    block_size = resolve_block_size(cfg.block_size, device.type)
    check_batch_invariant(cfg)
    # --batch-invariant: the compiled kernels choose paths by batch size, so none of them.
    cpu_kernels = cfg.cpu_kernels and not cfg.batch_invariant
    # Its own compiled kernels sum in an order fixed by each row's own shape (cpu_kernels/invariant.py).
    invariant = Invariant(invariant_kernels() if cfg.batch_invariant and cfg.cpu_kernels else None)
    if cfg.batch_invariant:
        backend = BatchInvariantAttention(invariant.kernels)
    else:
        backend = select_backend(cfg.attention, device, cpu_kernels=cpu_kernels)
    dtype, why = resolve_dtype(cfg.dtype, device)
    log.info("dtype %s (%s)", dtype, why)
    model, config = load_model(cfg.model_dir, parse_dtype(dtype), device, backend, group,
                               cpu_kernels=cpu_kernels, quantize=cfg.quantize, model_impl=cfg.model_impl,
                               huge_pages=cfg.huge_pages, gguf_weights=cfg.gguf_weights)  # fmt: skip
    if cfg.batch_invariant:
        how = "the compiled invariant kernels" if invariant.kernels else "torch on fixed-shape row tiles"
        log.info("batch-invariant: %d linears on %s", make_batch_invariant(model, invariant), how)
    draft = None
    if cfg.speculate > 0 and cfg.speculate_method == "draft":
        if not cfg.draft_model:
            raise ValueError("--speculate-method draft needs --draft-model DIR")
        # The draft is small: every rank runs all of it (replicated, no
        # communication), fed the same inputs and sampler, so proposals agree.
        d_model, d_config = load_model(cfg.draft_model, parse_dtype(dtype), device, backend,
                                       cpu_kernels=cpu_kernels, gguf_weights=cfg.gguf_weights)  # fmt: skip
        draft = DraftProposer(d_model, d_config, device, block_size)
    kwargs = dict(
        device=device,
        block_size=block_size,
        kv_cache_memory=cfg.kv_cache_memory,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        model_id=os.path.basename(os.path.normpath(cfg.model_dir)),
        model_dir=cfg.model_dir,
        speculate=cfg.speculate,
        draft=draft,
        cuda_graphs=cfg.cuda_graphs,
        kv_cache_dtype=cfg.kv_cache_dtype,
        cpu_kernels=cpu_kernels,
        kv_offload=TierOptions(cfg.kv_offload_dir, cfg.kv_offload_disk, cfg.kv_offload_memory),
        adaptive_threads=cfg.adaptive_threads,
        huge_pages=cfg.huge_pages,
    )
    return model, config, kwargs
