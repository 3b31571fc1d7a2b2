"""Puts a GGUF file's weights into a model built on the meta device, kept in their blocks.

Every linear of the model (q/k/v, o, gate/up, down, Phi-3's fused ones, each expert's, the MoE
router and shared-expert gate, the output head) becomes a GGUFLinear over the file's rows; the
embedding a GGUFEmbedding (a tied head is its table). Where the model fuses projections the
file keeps apart (q|k|v, gate|up), parts of one ggml type are one GGUFLinear, their rows read
into one buffer; parts of different types (Q4_K_M mixes them) a GGUFConcatLinear. Which rows
of which parameter a file tensor fills comes from the model's own checkpoint_targets, as for
safetensors. Norms and biases, the only float weights left, are dequantized to the model dtype.
Nothing else is materialized: no float copy of a quantized weight is ever made.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch import nn

from pagemill.models.gguf.linear import GGUFConcatLinear, GGUFEmbedding, GGUFLinear
from pagemill.models.gguf.names import Weight
from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.types import GGUFError
from pagemill.models.gguf.weights import float_weight, raw_rows
from pagemill.models.llama import LlamaForCausalLM, WeightTarget
from pagemill.parallel.partition import Range


@dataclass
class _Part:
    dest: int  # first output row of the fused linear it fills
    w: Weight
    src: Range | None  # its rows of the file tensor (None: all)


def _module(model: nn.Module, name: str, hf: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise GGUFError(f"GGUF weight {hf} has no place in the {model.config.model_type} model") from None


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _merge(parts: list[_Part]) -> list[_Part]:
    """Adjacent parts that are contiguous rows of one tensor become one (Phi-3's fused rows)."""
    out: list[_Part] = []
    for p in sorted(parts, key=lambda p: p.dest):
        last = out[-1] if out else None
        if last is not None and last.w == p.w and last.src is not None and p.src is not None \
                and last.src.end == p.src.start:
            out[-1] = _Part(last.dest, last.w, Range(last.src.start, last.src.size + p.src.size))
        else:
            out.append(p)
    return out


def _rows(g: GGUFModel, group: list[_Part], config: dict) -> tuple[torch.Tensor, bool]:
    """The group's rows as one uint8 tensor, and whether it is a view of the mapping."""
    def cut(t: torch.Tensor, src: Range | None) -> torch.Tensor:
        return t if src is None else t[src.start : src.end]

    if len(group) == 1:
        p = group[0]
        return cut(raw_rows(g, p.w, config), p.src), p.w.transform is None
    return torch.cat([cut(raw_rows(g, p.w, config, copy=True), p.src) for p in group]), False


def _linear(g: GGUFModel, old: nn.Linear, parts: list[_Part], config: dict, owner: str) -> nn.Module:
    parts = _merge(parts)
    groups: list[list[_Part]] = []
    for p in parts:
        same = groups and g.info(groups[-1][-1].w.gguf).type == g.info(p.w.gguf).type
        groups[-1].append(p) if same else groups.append([p])
    linears = []
    for group in groups:
        rows, mapped = _rows(g, group, config)
        try:
            linears.append(GGUFLinear(rows, g.info(group[0].w.gguf).type.id, old.in_features, mapped=mapped))
        except ValueError as e:
            raise GGUFError(f"{', '.join(p.w.gguf for p in group)} -> {owner}: {e}") from None
    total = sum(m.out_features for m in linears)
    if total != old.out_features:
        raise GGUFError(f"{owner}: the file's tensors give {total} output rows, the config implies {old.out_features}")
    return linears[0] if len(linears) == 1 else GGUFConcatLinear(linears)


def _set_bias(new: nn.Module, bias: torch.Tensor) -> None:
    parts = new.parts if isinstance(new, GGUFConcatLinear) else [new]
    for p, b in zip(parts, bias.split([p.out_features for p in parts])):
        p.bias = nn.Parameter(b.clone(), requires_grad=False)


def _fill(target: WeightTarget, value: torch.Tensor, dest: torch.Tensor, hf: str) -> None:
    if target.src is not None:
        value = value.narrow(target.src_dim, target.src.start, target.src.size)
    if target.dest is not None:
        dest = dest.narrow(0, target.dest.start, target.dest.size)
    if value.shape != dest.shape:
        raise GGUFError(f"GGUF weight {hf} has shape {list(value.shape)}, the config implies {list(dest.shape)}")
    dest.copy_(value)


def assemble_quantized(model: LlamaForCausalLM, g: GGUFModel, plan: list[Weight], config: dict,
                       dtype: torch.dtype) -> collections.Counter:  # fmt: skip
    """Fills `model` (built on the meta device, one unsharded rank) from `g`; returns the ggml
    type name -> count of its GGUF linears."""
    linears: dict[str, list[_Part]] = collections.defaultdict(list)
    floats: dict[str, list[tuple[Weight, WeightTarget]]] = collections.defaultdict(list)
    by_name = {w.hf: w for w in plan}
    for w in plan:
        if w.hf in ("model.embed_tokens.weight", "lm_head.weight"):
            continue
        for t in model.checkpoint_targets(w.hf):
            owner, _, leaf = t.param.rpartition(".")
            module = _module(model, owner, w.hf)
            if leaf == "weight" and isinstance(module, nn.Linear):
                if t.src_dim != 0 and t.src is not None and t.src.size != module.in_features:
                    raise GGUFError(f"{w.hf}: a column slice of GGUF blocks (tensor parallelism) is not supported")
                linears[owner].append(_Part(t.dest.start if t.dest else 0, w, t.src if t.src_dim == 0 else None))
            else:
                floats[t.param].append((w, t))
    for owner, parts in linears.items():
        old = model.get_submodule(owner)
        new = _linear(g, old, parts, config, owner)
        if old.bias is not None:
            bias = torch.zeros(old.out_features, dtype=torch.float32)
            for w, t in floats.pop(f"{owner}.bias", []):
                _fill(t, float_weight(g, w, config), bias, w.hf)
            _set_bias(new, bias.to(dtype))
        _replace(model, owner, new)
    _embedding_and_head(model, g, by_name, config, dtype)
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if param.device.type != "meta":
            continue
        sources = floats.pop(name, None)
        if not sources:
            raise GGUFError(f"the GGUF file has no weight for {name}")
        value = torch.empty(param.shape, dtype=torch.float32)
        for w, t in sources:
            _fill(t, float_weight(g, w, config), value, w.hf)
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(value.to(dtype), requires_grad=False))
    if floats:
        raise GGUFError(f"GGUF weights with no place in the model: {', '.join(sorted(floats))[:300]}")
    return collections.Counter(m.type_name for m in model.modules() if isinstance(m, GGUFLinear))


def _embedding_and_head(model: LlamaForCausalLM, g: GGUFModel, by_name: dict[str, Weight], config: dict,
                        dtype: torch.dtype) -> None:  # fmt: skip
    embed = by_name.get("model.embed_tokens.weight")
    if embed is None:
        raise GGUFError("the GGUF file has no token_embd.weight")
    vocab, hidden = model.layout.vocab.size, model.config.hidden_size
    table = GGUFLinear(raw_rows(g, embed, config), g.info(embed.gguf).type.id, hidden, mapped=True)
    if table.out_features != vocab:
        raise GGUFError(f"token_embd.weight has {table.out_features} rows, the vocabulary {vocab} tokens")
    model.model.embed_tokens = GGUFEmbedding(table, dtype)
    head = by_name.get("lm_head.weight")
    if model.config.tie_word_embeddings:
        model.lm_head = table  # the same blocks: no second copy, and no float one
    elif head is None:
        raise GGUFError("the GGUF file has no output.weight and does not tie it to the embedding")
    else:
        model.lm_head = GGUFLinear(raw_rows(g, head, config), g.info(head.gguf).type.id, hidden, mapped=True)
