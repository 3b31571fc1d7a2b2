"""The GGML tensor types a GGUF file may hold: block geometry, and which ones pagemill reads.

A quantized row of K values is K / block_size blocks of type_size bytes each; a 2-D weight
[N, K] is N such rows, back to back, in the order llama.cpp wrote them (row n = output feature n).
"""

from __future__ import annotations

from dataclasses import dataclass


class GGUFError(ValueError):
    """A GGUF file pagemill cannot serve: the message names what (architecture, type, tensor, key)."""


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_size: int  # values per block
    type_size: int  # bytes per block

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k values (k a multiple of block_size)."""
        return k // self.block_size * self.type_size

    @property
    def is_float(self) -> bool:
        """A plain float layout (F32, F16, BF16): one value per block."""
        return self.block_size == 1


# ggml type ids (ggml.h's enum ggml_type), with their block geometry (gguf-py's GGML_QUANT_SIZES).
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30
ALL_TYPES: dict[int, GGMLType] = {t.id: t for t in (
    GGMLType(F32, "F32", 1, 4),
    GGMLType(F16, "F16", 1, 2),
    GGMLType(Q4_0, "Q4_0", 32, 18),
    GGMLType(Q4_1, "Q4_1", 32, 20),
    GGMLType(Q5_0, "Q5_0", 32, 22),
    GGMLType(Q5_1, "Q5_1", 32, 24),
    GGMLType(Q8_0, "Q8_0", 32, 34),
    GGMLType(9, "Q8_1", 32, 36),
    GGMLType(Q2_K, "Q2_K", 256, 84),
    GGMLType(Q3_K, "Q3_K", 256, 110),
    GGMLType(Q4_K, "Q4_K", 256, 144),
    GGMLType(Q5_K, "Q5_K", 256, 176),
    GGMLType(Q6_K, "Q6_K", 256, 210),
    GGMLType(15, "Q8_K", 256, 292),
    GGMLType(16, "IQ2_XXS", 256, 66),
    GGMLType(17, "IQ2_XS", 256, 74),
    GGMLType(18, "IQ3_XXS", 256, 98),
    GGMLType(19, "IQ1_S", 256, 50),
    GGMLType(20, "IQ4_NL", 32, 18),
    GGMLType(21, "IQ3_S", 256, 110),
    GGMLType(22, "IQ2_S", 256, 82),
    GGMLType(23, "IQ4_XS", 256, 136),
    GGMLType(24, "I8", 1, 1),
    GGMLType(25, "I16", 1, 2),
    GGMLType(26, "I32", 1, 4),
    GGMLType(27, "I64", 1, 8),
    GGMLType(28, "F64", 1, 8),
    GGMLType(29, "IQ1_M", 256, 56),
    GGMLType(BF16, "BF16", 1, 2),
    GGMLType(34, "TQ1_0", 256, 54),
    GGMLType(35, "TQ2_0", 256, 66),
    GGMLType(39, "MXFP4", 32, 17),
)}
# What dequant.py computes (and the GGUF modules therefore serve).
SUPPORTED_TYPES = (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)


def supported_names() -> str:
    return ", ".join(ALL_TYPES[t].name for t in SUPPORTED_TYPES)


def ggml_type(type_id: int, tensor: str) -> GGMLType:
    """The type of `tensor`, or GGUFError naming the type and the tensor where pagemill cannot read it."""
    t = ALL_TYPES.get(int(type_id))
    if t is None:
        raise GGUFError(f"GGUF tensor {tensor!r} has unknown ggml type id {int(type_id)}")
    if t.id not in SUPPORTED_TYPES:
        raise GGUFError(f"GGUF tensor {tensor!r} has type {t.name}, which pagemill does not read "
                        f"(supported: {supported_names()})")  # fmt: skip
    return t
