"""Loads a Hugging Face safetensors checkpoint directory into our model; a GGUF model (a .gguf
file, or the directory the launcher extracted for one) goes to models/gguf/load.py."""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Callable, Iterable

import torch
from safetensors import safe_open

from pagemill.attention.backend import AttentionBackend
from pagemill.config import check_quantize
from pagemill.models.huge_pages import move_packed_to_huge_pages, move_to_huge_pages
from pagemill.models.config import ModelConfig
from pagemill.models.architectures import model_class
from pagemill.models.impl import choose_impl
from pagemill.models.llama import LlamaForCausalLM
from pagemill.models.quantized_linear import quantize_model
from pagemill.parallel.group import ParallelGroup
from pagemill.parallel.partition import Range

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint entries that are not weights of ours (older HF exports store rope buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: from the sharded index if present, else every *.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir!r} (pytorch_model.bin checkpoints are not supported; convert them)"
        )
    return files


def load_model(
    model_dir: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
    group: ParallelGroup | None = None,
    cpu_kernels: bool = True,
    quantize: str | None = None,
    model_impl: str = "auto",
    huge_pages: bool = False,
    gguf_weights: str = "quantized",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """group: this rank's tensor-parallel group; the rank then reads only its slices.
    cpu_kernels: use the compiled CPU decode kernels (matvec, fused small-batch decode; docs/cpu.md).
    quantize: None, or "int8" for int8 linears (models/quantized_linear.py; CPU, one shard).
    model_impl: auto, native or transformers (models/impl.py).
    huge_pages: CPU weights in one huge-page arena (models/huge_pages.py).
    gguf_weights: a GGUF model's weights kept in their blocks ("quantized") or "dequantized"."""
    dtype, device = parse_dtype(dtype), torch.device(device)
    world_size = group.world_size if group is not None else 1
    from pagemill.models.gguf.extract import gguf_source

    gguf = gguf_source(model_dir)
    if gguf is not None:
        from pagemill.models.gguf.load import load_gguf

        return load_gguf(gguf, model_dir, dtype, device, backend, group, cpu_kernels, gguf_weights, quantize, huge_pages)
    check_quantize(quantize, device.type, world_size)
    choice = choose_impl(model_dir, model_impl, world_size, quantize)
    log.info("model %s: %s implementation, %s", choice.architecture, choice.impl, choice.why)
    if choice.impl == "transformers":
        from pagemill.models.transformers_backend import load_transformers_model

        if backend is None:
            from pagemill.attention.torch_backend import TorchAttentionBackend

            backend = TorchAttentionBackend()
        return load_transformers_model(model_dir, dtype, device, backend)
    config = ModelConfig.from_model_dir(model_dir)
    # Build on the meta device: no time spent on random init we would overwrite.
    with torch.device("meta"):
        model = model_class(config)(config, backend, group).to(dtype)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty created fresh parameters
    load_weights(model, safetensors_files(model_dir))
    finish_model(model, config, device, cpu_kernels, quantize, huge_pages)
    return model, config


def finish_model(model: LlamaForCausalLM, config: ModelConfig, device: torch.device, cpu_kernels: bool,
                 quantize: str | None, huge_pages: bool) -> None:  # fmt: skip
    """What follows loading float weights: eval mode, int8 quantization, huge pages, packing."""
    model.eval().requires_grad_(False)
    if quantize is not None:
        quantize_model(model, cpu_kernels)
    if huge_pages and device.type == "cpu":
        move_to_huge_pages(model)  # before pack_weights takes pointers into the weights
    model.pack_weights(cpu_kernels)  # CPU float32/bf16 only; see models/packed_linear.py
    if huge_pages and device.type == "cpu":
        move_packed_to_huge_pages(model)  # the copies pack_weights made (bf16: gemm_bf16's)
    if config.layer_windows:
        windowed = sum(w is not None for w in config.layer_windows)
        log.info("sliding window %d tokens in %d of %d layers", config.sliding_window, windowed,
                 config.num_hidden_layers)  # fmt: skip


# Reads the part of a checkpoint tensor a rank needs: (dim, Range or None: all) -> tensor.
SliceReader = Callable[[int, Range | None], torch.Tensor]


def load_weights(model: LlamaForCausalLM, files: list[str]) -> None:
    def entries() -> Iterable[tuple[str, SliceReader, str]]:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, lambda dim, part, sl=f.get_slice(name): _read(sl, dim, part), path

    fill_weights(model, entries())


@torch.no_grad()
def fill_weights(model: LlamaForCausalLM, entries: Iterable[tuple[str, SliceReader, str]]) -> None:
    """Copies each checkpoint tensor (HF name, reader, where it comes from) into the rows of our
    parameters it fills on this rank (model.checkpoint_targets); raises on missing weights."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.config.tie_word_embeddings
    # What a complete checkpoint holds, in its own (HF) names.
    expected = model.checkpoint_names()
    loaded: set[str] = set()
    for name, read, path in entries:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if tied and name == "lm_head.weight":
            continue  # the embedding is the output projection
        targets = model.checkpoint_targets(name)
        if name not in expected or any(t.param not in params for t in targets):
            log.warning("ignoring checkpoint tensor %s (no such parameter)", name)
            continue
        for target in targets:
            param = params[target.param]
            dest = param.narrow(0, target.dest.start, target.dest.size) if target.dest else param
            tensor = read(target.src_dim, target.src)
            if tensor.shape != dest.shape:
                raise ValueError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}, the config implies {tuple(dest.shape)}"
                    + (f" (this rank's slice of {name})" if target.src else "")
                )
            dest.copy_(tensor)  # casts to the model dtype and device
        loaded.add(name)
    if tied and "model.embed_tokens.weight" in loaded:
        loaded.add("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        hint = " (set tie_word_embeddings in config.json if lm_head shares the embedding)" if missing == [
            "lm_head.weight"
        ] else ""
        raise ValueError(f"checkpoint is missing {len(missing)} weights: {', '.join(missing[:8])}{hint}")


def _read(sl, dim: int, part: Range | None) -> torch.Tensor:
    """The part of a safetensors slice a rank needs, reading only those bytes from the file."""
    if part is None:
        return sl[:]
    if dim == 0:
        return sl[part.start : part.end]
    return sl[:, part.start : part.end]
