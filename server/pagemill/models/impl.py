"""Which implementation runs a checkpoint: our native module (models/architectures.py) or
transformers' modeling code over our paged attention (models/transformers_backend.py).

Decided from config.json alone, before any weight is read, by the launcher (so that
`pagemill launch` fails before starting shards) and again by each shard's loader.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pagemill.config import MODEL_IMPLS


@dataclass(frozen=True)
class ImplChoice:
    impl: str  # "native" | "transformers"
    architecture: str  # config.json's architectures[0] (or its model_type)
    why: str  # for the startup log


def choose_impl(model_dir: str, requested: str = "auto", world_size: int = 1,
                quantize: str | None = None) -> ImplChoice:  # fmt: skip
    """Raises ValueError naming the architecture where the requested implementation cannot serve it."""
    from pagemill.models.config import ModelConfig

    if requested not in MODEL_IMPLS:
        raise ValueError(f"unknown model implementation {requested!r}; choose one of {', '.join(MODEL_IMPLS)}")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir!r} has no config.json")
    with open(path) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    arch = (raw.get("architectures") or [f"model_type {model_type!r}"])[0]
    native_error = None
    try:
        ModelConfig.from_dict(raw)
    except (ValueError, KeyError, TypeError) as e:
        native_error = f"{e}" if not isinstance(e, KeyError) else f"config.json lacks {e}"
    if requested == "native" or (requested == "auto" and native_error is None):
        if native_error is not None:
            raise ValueError(f"{arch} has no native pagemill implementation: {native_error} "
                             "(--model-impl transformers runs transformers' modeling code instead)")  # fmt: skip
        return ImplChoice("native", arch, f"pagemill's own {model_type} code")
    tf_error = transformers_support(model_type)
    if tf_error is not None:
        if requested == "transformers":
            raise ValueError(f"{arch} cannot run through transformers: {tf_error}")
        raise ValueError(f"pagemill cannot serve {arch}: no native implementation ({native_error}), "
                         f"and through transformers {tf_error}")  # fmt: skip
    attention_error = transformers_attention_support(model_dir)
    if attention_error is not None:
        native = "" if native_error is not None else "; its native implementation does (--model-impl auto or native)"
        raise ValueError(f"{arch} cannot run through transformers with pagemill's paged attention: "
                         f"{attention_error}{native}")  # fmt: skip
    if world_size != 1:
        raise ValueError(f"{arch} runs through transformers' modeling code, which pagemill does not shard: "
                         f"use one shard (got {world_size})")  # fmt: skip
    if quantize is not None:
        raise ValueError(f"--quantize {quantize} needs a native model; {arch} runs through transformers")
    why = "forced by --model-impl" if requested == "transformers" else f"no native code: {native_error}"
    return ImplChoice("transformers", arch, f"transformers' modeling code with pagemill's paged attention ({why})")


def transformers_support(model_type: str | None) -> str | None:
    """None where transformers has a causal LM for `model_type` whose attention goes through its
    AttentionInterface (what our paged attention plugs into), else why not."""
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return "transformers is not installed"
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type or "")
    if name is None:
        return f"transformers {transformers.__version__} has no causal LM for model_type {model_type!r}"
    cls = getattr(transformers, name, None)
    if cls is None or not getattr(cls, "_supports_attention_backend", False):
        return f"{name}'s attention does not go through transformers' attention interface"
    return None


def transformers_attention_support(model_dir: str) -> str | None:
    """None where every attention layer of the checkpoint is plain causal attention (all our paged
    attention function applies), else which config field asks for more. Read from transformers'
    parsed config, whose defaults count (Gemma 2 soft-caps unless config.json says otherwise); found
    here at launch, rather than when warmup's first forward hands the attention function a window."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap:
        return f"`attn_logit_softcapping` is {softcap} (attention-logit soft-capping is not applied)"
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        local = sorted({t for t in layer_types if t != "full_attention"})
        if local:
            return (f"`layer_types` has {', '.join(local)} layers (sliding_window="
                    f"{getattr(text, 'sliding_window', None)}; windows are not applied)")
        return None
    window = getattr(text, "sliding_window", None)
    if window and getattr(text, "use_sliding_window", True) is not False:
        return f"`sliding_window` is {window} (windows are not applied)"
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk:
        return f"`attention_chunk_size` is {chunk} (chunked attention is not applied)"
    return None
