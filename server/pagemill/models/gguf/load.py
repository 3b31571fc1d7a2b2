"""Loads a GGUF model into our native model classes.

`--gguf-weights quantized` (the default): the weights stay in the file's blocks (assemble.py:
GGUFLinear everywhere, zero-copy views of the file's mapping where rows are used as stored),
on one shard. `dequantized`: every weight is dequantized to --dtype through the same loading
path as safetensors, so tensor parallelism and `--quantize int8` apply as for any checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagemill.attention.backend import AttentionBackend
from pagemill.config import check_gguf, check_quantize
from pagemill.models.architectures import model_class
from pagemill.models.config import ModelConfig
from pagemill.models.gguf.archs import hf_config
from pagemill.models.gguf.assemble import assemble_quantized
from pagemill.models.gguf.files import generation_config
from pagemill.models.gguf.names import weight_plan
from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.tokenizer import end_of_generation_ids, read_spec
from pagemill.models.gguf.weights import float_weight
from pagemill.models.llama import LlamaForCausalLM
from pagemill.models.loader import finish_model, fill_weights
from pagemill.parallel.group import ParallelGroup
from pagemill.parallel.partition import Range

log = logging.getLogger(__name__)


def model_config(g: GGUFModel, hf: dict, model_dir: str | Path) -> ModelConfig:
    """The extracted directory's config (what the router read too), or the file's own."""
    if Path(model_dir).is_dir():
        return ModelConfig.from_model_dir(str(model_dir))
    spec = read_spec(g, hf["max_position_embeddings"])
    return ModelConfig.from_dict(hf, generation_config(hf, end_of_generation_ids(spec) or [hf["eos_token_id"]]))


def _narrow(t: torch.Tensor, dim: int, part: Range | None) -> torch.Tensor:
    return t if part is None else t.narrow(dim, part.start, part.size)


def load_gguf(path: Path, model_dir: str | Path, dtype: torch.dtype, device: torch.device,
              backend: AttentionBackend | None, group: ParallelGroup | None, cpu_kernels: bool,
              gguf_weights: str, quantize: str | None, huge_pages: bool) -> tuple[LlamaForCausalLM, ModelConfig]:  # fmt: skip
    world = group.world_size if group is not None else 1
    check_gguf(gguf_weights, world, quantize)
    check_quantize(quantize, device.type, world)
    g = GGUFModel(path)
    hf = hf_config(g)
    config = model_config(g, hf, model_dir)
    with torch.device("meta"):
        model = model_class(config)(config, backend, group).to(dtype)
    plan = weight_plan(g, hf)
    files = ", ".join(p.name for p in g.paths)
    if gguf_weights == "dequantized":
        model.to_empty(device=device)
        model.tie_weights()
        fill_weights(model, ((w.hf, lambda dim, part, w=w: _narrow(float_weight(g, w, hf), dim, part), files)
                             for w in plan))  # fmt: skip
        finish_model(model, config, device, cpu_kernels, quantize, huge_pages)
        log.info("GGUF %s (%s): dequantized to %s", files, g.architecture, dtype)
        return model, config
    counts = assemble_quantized(model, g, plan, hf, dtype)
    model.to(device).eval().requires_grad_(False)
    if huge_pages and device.type == "cpu":
        log.info("huge pages: not applied to GGUF blocks (they stay the file's mapping)")
    model.pack_weights(cpu_kernels)
    on_kernel = sum(m.prepared is not None for m in model.modules() if hasattr(m, "prepared"))
    log.info("GGUF %s (%s): weights kept quantized, %s; %d of %d linears on the compiled kernels, the rest torch "
             "(dequantize per call)", files, g.architecture, ", ".join(f"{n} {t}" for t, n in sorted(counts.items())),
             on_kernel, sum(counts.values()))  # fmt: skip
    return model, config
