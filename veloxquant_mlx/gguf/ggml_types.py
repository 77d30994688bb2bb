"""The ggml tensor types: ids, names, block geometry, and which ones we convert.

The table covers every type a GGUF file can name, not only the supported ones,
so that an unsupported tensor still gets its byte size checked (truncation) and
its type reported by name rather than by a bare number.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type.

    Attributes:
        type_id: The number stored in the GGUF tensor info.
        name: The ggml name (``"Q4_0"``).
        block_size: Elements per block (1 for plain types).
        type_size: Bytes per block.
    """

    type_id: int
    name: str
    block_size: int
    type_size: int

    def nbytes(self, n_elements: int) -> int:
        """Bytes taken by ``n_elements`` values (a whole number of blocks)."""
        return n_elements // self.block_size * self.type_size


# (id, name, elements per block, bytes per block), from the ggml type traits.
_TABLE = [
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
]

GGML_TYPES: dict[int, GGMLType] = {row[0]: GGMLType(*row) for row in _TABLE}

# What convert_gguf accepts: the float types, kept as float tensors, and the
# block types that veloxquant_mlx.gguf.blocks decodes (exact MLX affine
# quantization with group size 32 where ggml's layout allows, else float32).
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOAT_TYPES + ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                                 "Q6_K", "Q3_K", "Q2_K")

# Bits of the MLX affine quantization each quantized GGUF type becomes; the
# block types missing here (16 values a scale) become float32 matrices.
QUANT_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5}

# Affine groups run 32 values along a row, as ggml's blocks (or their sub-blocks) do.
GROUP_SIZE = 32
