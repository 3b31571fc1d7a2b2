"""One HF parameter's data out of a GGUF model: as float32 values (dequantized, for norms,
biases and the dequantized loading paths) or as raw rows of blocks (kept quantized), with
names.py's transform undone either way.
"""

from __future__ import annotations

import torch

from pagemill.models.gguf.dequant import dequantize
from pagemill.models.gguf.names import NORM_PLUS_ONE, PERMUTE_K, PERMUTE_Q, ROW_VECTOR, Weight, unpermute_rows
from pagemill.models.gguf.reader import GGUFModel, TensorInfo
from pagemill.models.gguf.types import GGUFError


def _heads(w: Weight, config: dict) -> int:
    return int(config["num_attention_heads"] if w.transform == PERMUTE_Q else config["num_key_value_heads"])


def _info(g: GGUFModel, w: Weight) -> TensorInfo:
    t = g.info(w.gguf)
    if w.expert is not None and (len(t.shape) != 3 or not 0 <= w.expert < t.shape[0]):
        raise GGUFError(f"{w.gguf} has shape {list(t.shape)}; expected [n_expert, rows, K] with expert {w.expert}")
    return t


def raw_rows(g: GGUFModel, w: Weight, config: dict, copy: bool = False) -> torch.Tensor:
    """The parameter's rows of blocks, uint8 [N, row_bytes] (1-D parameters: [1, row_bytes]).
    A zero-copy view into the file's mapping where the rows are used as stored, else (copy, or
    rows to permute) a copy read from the file with the mapping untouched, so that a weight
    rewritten at load is never resident twice."""
    t = _info(g, w)
    permute = w.transform in (PERMUTE_Q, PERMUTE_K)
    if w.transform == NORM_PLUS_ONE:
        raise GGUFError(f"{w.gguf} is a norm weight: it loads as floats, not blocks")
    if permute or copy:
        rows = g.read(w.gguf, None if w.expert is None else slice(w.expert, w.expert + 1))
        rows = rows.reshape(-1, t.byte_shape[-1])
        return unpermute_rows(rows, _heads(w, config)).contiguous() if permute else rows
    raw = g.raw(w.gguf)
    if w.expert is not None:
        raw = raw[w.expert]
    return raw.reshape(-1, t.byte_shape[-1])


def float_weight(g: GGUFModel, w: Weight, config: dict) -> torch.Tensor:
    """The parameter as float32 values, in HF's shape ([out, in] for a linear, [n] for a vector)."""
    t = _info(g, w)
    raw = g.raw(w.gguf)
    if w.expert is not None:
        raw = raw[w.expert]
    values = dequantize(raw, t.type.id)
    if w.transform in (PERMUTE_Q, PERMUTE_K):
        values = unpermute_rows(values, _heads(w, config))
    elif w.transform == NORM_PLUS_ONE:
        values = values - 1.0  # llama.cpp stored 1 + w (computed in float32, as transformers undoes it)
    elif w.transform == ROW_VECTOR:
        values = values.reshape(1, -1)
    return values.contiguous()
