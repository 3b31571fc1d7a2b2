"""A PEFT LoRA adapter directory read and checked: adapter_config.json + adapter_model.safetensors.

PEFT saves, per adapted linear `<module>`, `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]; the adapted output is base(x) + scaling * B (A x), with scaling
lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (PEFT's LoraLayer.update_layer). Only
what that formula covers is accepted: anything else PEFT can save (DoRA, per-module rank or
alpha patterns, trained biases, extra saved modules, embedding targets) changes the product, so
it is refused by name rather than silently served as something else.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The decoder projections an adapter may target, in HF names (qkv_proj / gate_up_proj: Phi-3's fused ones).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                  "gate_up_proj")  # fmt: skip
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message is what the request's error says."""


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter as read from disk, before it is fitted to a model (layers.fit_adapter)."""

    path: str
    rank: int
    scaling: float
    # HF module name (model.layers.0.self_attn.q_proj) -> (A [r, in], B [out, r]), float32
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def scaling(lora_alpha: float, r: int, use_rslora: bool) -> float:
    """PEFT's scaling: rank-stabilised LoRA divides by sqrt(r) instead of r."""
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def read_adapter(path: str, max_rank: int) -> PeftAdapter:
    """Reads and checks the adapter at `path`; raises AdapterError saying what is wrong."""
    cfg = _read_config(path)
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise AdapterError(f"adapter {path}: rank r={r!r} in {CONFIG_FILE} must be a positive integer")
    if r > max_rank:
        raise AdapterError(f"adapter {path}: rank {r} is larger than the server's max LoRA rank {max_rank}")
    _refuse_unsupported(path, cfg)
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"adapter {path}: lora_alpha {alpha!r} is not a number")
    weights = _read_weights(path, r)
    return PeftAdapter(path, r, scaling(float(alpha), r, bool(cfg.get("use_rslora", False))), weights)


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise AdapterError(f"adapter path {path} is not a directory")
    if not os.path.isfile(file):
        raise AdapterError(f"adapter {path} has no {CONFIG_FILE}")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {path}: {CONFIG_FILE} is unreadable: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"adapter {path}: {CONFIG_FILE} is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"adapter {path}: peft_type {peft_type!r} is not LORA")
    return cfg


def _refuse_unsupported(path: str, cfg: dict) -> None:
    """PEFT options that change the product or add weights beyond A and B."""
    refused = [
        ("use_dora", "DoRA (use_dora)", bool(cfg.get("use_dora"))),
        ("rank_pattern", "per-module ranks (rank_pattern)", bool(cfg.get("rank_pattern"))),
        ("alpha_pattern", "per-module alphas (alpha_pattern)", bool(cfg.get("alpha_pattern"))),
        ("modules_to_save", "fully trained modules (modules_to_save)", bool(cfg.get("modules_to_save"))),
        ("bias", f"trained biases (bias={cfg.get('bias')!r})", cfg.get("bias", "none") not in ("none", None)),
        ("lora_bias", "LoRA biases (lora_bias)", bool(cfg.get("lora_bias"))),
        ("fan_in_fan_out", "transposed (Conv1D) weights (fan_in_fan_out)", bool(cfg.get("fan_in_fan_out"))),
    ]
    for _, what, on in refused:
        if on:
            raise AdapterError(f"adapter {path}: {what} is not supported")


def _read_weights(path: str, r: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise AdapterError(f"adapter {path} has no {WEIGHTS_FILE}")
    try:
        tensors = load_file(file)
    except (OSError, SafetensorError) as e:
        raise AdapterError(f"adapter {path}: {WEIGHTS_FILE} is unreadable: {e}") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"adapter {path}: tensor {key} is not a LoRA A or B weight (embedding targets, DoRA "
                               "magnitudes and saved modules are not supported)")  # fmt: skip
        module = m["module"]
        leaf = module.rpartition(".")[2]
        if leaf not in TARGET_MODULES:
            raise AdapterError(f"adapter {path}: target module {leaf} ({module}) is not supported; "
                               f"supported: {', '.join(TARGET_MODULES)}")  # fmt: skip
        if t.dim() != 2 or not t.is_floating_point():
            raise AdapterError(f"adapter {path}: {key} is not a 2-D float tensor")
        halves.setdefault(module, {})[m["ab"]] = t.float()
    if not halves:
        raise AdapterError(f"adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for module, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {path}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != r or b.shape[1] != r:
            raise AdapterError(f"adapter {path}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
                               f"not rank r={r}")  # fmt: skip
        weights[module] = (a, b)
    return weights
