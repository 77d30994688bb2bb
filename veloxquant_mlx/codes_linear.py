"""Linear and embedding layers that compute from 4/8-bit weight codes (MLX's CPU backend).

A quantized model's ``nn.QuantizedLinear`` runs MLX's CPU quantized matmul, which is
several times slower than float32 on an optimized BLAS; dequantizing to float32 is fast
but holds 4 bytes a weight. :class:`CodesLinear` keeps the codes (0.625 bytes a weight
at 4 bits with float16 scales and biases, 1.125 at 8) and multiplies through the project's
``codes_matmul`` operation (``veloxquant_mlx/kernels``): int8 activations and integer dot
products for decode-sized products, float32 for prompts (see INT8_MAX_ROWS).
:func:`use_codes` swaps a loaded model's quantized layers for these; the numbers are the
checkpoint's own codes, scales and biases.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from veloxquant_mlx.quant_weights import (
    GROUP,
    QuantizedParts,
    kernel_codes,
    kernel_group,
    kernel_groups,
    widen_to_8_bits,
)

# Products of more rows than this (prompts, large batches) multiply float32 activations by
# the dequantized weights (kernels/codes_gemm.c); smaller ones (decode) use int8
# activations. A prompt's logits are then those of the float32 model: int8 activations
# flipped SmolLM2's near-tie first answer to "What is the capital of France?".
INT8_MAX_ROWS = 16
# The LM head's logits decide every token: after its int8 product each row's largest
# logits (the kernel's ``exact_top``) are recomputed in float32. With int8 alone SmolLM2's
# perplexity on the test paragraph was 1.1% above float32's.
PRECISE_LAYERS = ("lm_head",)


def codes_op() -> Any:
    """The built extension's ``codes_matmul`` (builds it on first use)."""
    from veloxquant_mlx.kernels.build import load

    return load().codes_matmul


class CodesLinear(nn.Module):
    """``x @ W.T (+ bias)`` with W held as codes in the kernel's layout.

    Parameters (arrays, so MLX's module tools see them): ``weight`` (uint8 codes, rows x
    cols*bits/8), ``scales`` and ``biases`` (float16 where exact, else float32; rows x
    cols/group, of the unsigned codes), and ``bias``
    when the layer had one. Rows come first in each, so sibling layers can be stacked.
    """

    def __init__(self, parts: QuantizedParts, bias: mx.array | None = None,
                 precise: bool = False) -> None:
        super().__init__()
        scales, biases = kernel_groups(parts)
        self.weight = mx.array(kernel_codes(parts.packed, parts.bits))
        # float16 where that holds them exactly (GGUF's Q4_0, Q4_1, Q8_0, MLX's float16
        # checkpoints): 0.625 bytes a weight at 4 bits in all; else float32 (K-quants'
        # products of two scales).
        exact = all(np.array_equal(v.astype(np.float16).astype(np.float32), v)
                    for v in (scales, biases))
        kind = np.float16 if exact else np.float32
        self.scales = mx.array(scales.astype(kind))
        self.biases = mx.array(biases.astype(kind))
        if bias is not None:
            self.bias = bias
        self.bits = parts.bits
        self.group = kernel_group(parts)
        self.precise = precise
        self._op = codes_op()

    def __call__(self, x: mx.array) -> mx.array:
        y = self._op(x, self.weight, self.scales, self.biases, bits=self.bits, group=self.group,
                     float32_above=INT8_MAX_ROWS, precise=self.precise)
        return y + self.bias if "bias" in self else y


class CodesEmbedding(CodesLinear):
    """An embedding table held as codes: rows are looked up and decoded, and
    :meth:`as_linear` (a tied LM head, precise) multiplies by the same codes."""

    def __init__(self, parts: QuantizedParts) -> None:
        super().__init__(parts, precise=True)

    def __call__(self, ids: mx.array) -> mx.array:
        rows = self.weight[ids]
        if self.bits == 4:  # per 32 columns: low nibbles are columns 0-15, high 16-31
            halves = rows.reshape(*rows.shape[:-1], -1, GROUP // 2)
            q = mx.concatenate([halves & 0x0F, halves >> 4], axis=-1).astype(mx.float32)
        else:  # signed codes, q - 128 (the biases are the unsigned codes')
            q = mx.view(rows, mx.int8).astype(mx.float32) + 128
        q = q.reshape(*ids.shape, -1, self.group)
        values = q * self.scales[ids][..., None] + self.biases[ids][..., None]
        return values.reshape(*values.shape[:-2], -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return CodesLinear.__call__(self, x)


def layer_parts(module: nn.Module) -> QuantizedParts | None:
    """A quantized layer's codes as the kernel takes them, or None when it cannot serve it
    (another mode, no biases, or a group size that is not a multiple of 32)."""
    if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return None
    if (module.bits not in (2, 3, 4, 5, 6, 8) or getattr(module, "mode", "affine") != "affine"
            or module.group_size % GROUP or module.biases is None):
        return None
    packed, bits = np.array(module.weight), module.bits
    if bits not in (4, 8):  # other widths are served as bytes: the same numbers
        packed, bits = widen_to_8_bits(packed, bits), 8
    scales, biases = (np.array(v.astype(mx.float32)) for v in (module.scales, module.biases))
    return QuantizedParts(packed, scales, biases, module.group_size, bits)


def use_codes(model: nn.Module, group16: dict[str, QuantizedParts] | None = None) -> int:
    """Replace ``model``'s quantized layers with :class:`CodesLinear` / :class:`CodesEmbedding`.

    Args:
        model: A loaded mlx-lm model.
        group16: Codes of float32 matrices with 16-column groups (a GGUF's Q6_K, Q3_K
            and Q2_K, see ``quant_weights.load_group16_parts``): those layers become
            codes too, and their float32 weights are dropped.

    Returns:
        How many layers now compute from codes. Layers the kernel cannot serve stay as
        they were.
    """
    group16 = group16 or {}
    # Paths first (named_modules must not see half a swap), then one layer at a time: a
    # layer's repacked copy exists only until it replaces the original, so the load holds
    # one layer beyond the weights, not a second copy of them all.
    targets = [path for path, module in model.named_modules()
               if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
               or (path in group16 and isinstance(module, (nn.Linear, nn.Embedding)))]
    replaced = 0
    for path in targets:
        *parents, name = path.split(".")
        parent: Any = model
        for key in parents:  # modules and lists of modules (model.layers.3.mlp)
            parent = parent[int(key)] if isinstance(parent, list) else getattr(parent, key)
        layer = _codes_layer(path, parent[int(name)] if isinstance(parent, list)
                             else getattr(parent, name), group16.get(path))
        if layer is None:
            continue
        mx.eval(layer.parameters())
        if isinstance(parent, list):
            parent[int(name)] = layer
        else:
            setattr(parent, name, layer)
        replaced += 1
        mx.clear_cache()  # the original's buffers go back now, not after the last layer
    return replaced


def _codes_layer(path: str, module: nn.Module, group16: QuantizedParts | None
                 ) -> nn.Module | None:
    """The codes layer replacing ``module`` (None: the kernel cannot serve it)."""
    parts = layer_parts(module)
    if parts is None and group16 is not None:
        parts = group16
    if parts is None:
        return None
    if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
        return CodesEmbedding(parts)
    precise = path.rsplit(".", 1)[-1] in PRECISE_LAYERS
    return CodesLinear(parts, module.get("bias"), precise)
