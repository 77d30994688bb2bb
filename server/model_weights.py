"""Choose how the served model's weights are held in memory (engine thread only).

On MLX's CPU backend only float32 matmuls have a fast (BLAS) path: its
quantized matmul is many times slower than float32 on OpenBLAS for a small
model. So ``dtype = "auto"`` on CPU dequantizes quantized weights to float32
when the float32 copy fits the ``model.max_dequantized_bytes`` budget, and
otherwise keeps them packed (scales and biases still go float32). On a GPU or
Metal backend the packed weights stay: there the quantized kernels are fast
and memory is the scarcer resource.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

FLOAT32_BYTES = 4


@dataclass(slots=True, frozen=True)
class WeightPlan:
    """What load does to the weights, and the one phrase the start-up line uses.

    Attributes:
        cast_to: dtype name to cast floating parameters to, or None to keep them.
        dequantize: True to replace quantized layers with float layers first.
        note: How the weights are held, for the start-up log line.
        slow: ``auto`` had to keep quantized weights packed on CPU (worth a warning).
    """

    cast_to: str | None
    dequantize: bool
    note: str
    slow: bool = False


def machine_memory_bytes() -> int:
    """Physical memory of this machine (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def dequantize_budget(max_dequantized_bytes: int) -> int:
    """The float32 budget in bytes: the setting, or half the RAM when it is 0."""
    return max_dequantized_bytes or machine_memory_bytes() // 2


def float32_bytes(model: Any) -> int:
    """Bytes the model's parameters would take as float32 once dequantized."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    elements = sum(v.size for _, v in tree_flatten(model.parameters()))
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            # Swap the packed words, scales and biases for the logical weight.
            rows, words = module.weight.shape
            elements += rows * words * (32 // module.bits)
            elements -= module.weight.size + module.scales.size
            elements -= module.biases.size if module.biases is not None else 0
    return elements * FLOAT32_BYTES


def plan_weights(requested: str, on_gpu: bool, quantized: bool, f32_bytes: int,
                 budget: int) -> WeightPlan:
    """Decide cast and dequantization from the ``model.dtype`` setting.

    Args:
        requested: ``model.dtype``: auto, native, float32, float16 or bfloat16.
        on_gpu: MLX's default device is a GPU (CUDA or Metal).
        quantized: The model has quantized layers.
        f32_bytes: Size of a float32 copy of every weight.
        budget: Largest float32 copy ``auto`` may make (bytes).
    """
    if requested == "native":
        return WeightPlan(None, False, "weights as stored")
    if requested != "auto":
        kind = "packed quantized weights, float parameters" if quantized else "weights"
        return WeightPlan(requested, False, f"{kind} cast to {requested}")
    if on_gpu:
        return WeightPlan(None, False, "weights as stored (GPU)")
    if not quantized:
        return WeightPlan("float32", False, "float32 weights")
    mb, budget_mb = f32_bytes / 2**20, budget / 2**20
    if f32_bytes <= budget:
        return WeightPlan("float32", True,
                          f"quantized weights dequantized to float32 ({mb:.0f} MiB)")
    return WeightPlan("float32", False,
                      f"quantized weights kept packed: a float32 copy ({mb:.0f} MiB) exceeds "
                      f"model.max_dequantized_bytes ({budget_mb:.0f} MiB), and MLX's CPU "
                      "quantized matmul is slow, so expect low tokens/s", slow=True)


def apply_plan(model: Any, plan: WeightPlan) -> None:
    """Dequantize and cast ``model`` in place as ``plan`` says, then materialize it."""
    import mlx.core as mx

    if plan.dequantize:
        from mlx_lm.utils import dequantize_model

        dequantize_model(model)
    if plan.cast_to is not None:
        model.set_dtype(getattr(mx, plan.cast_to))
    mx.eval(model.parameters())


def is_quantized(model: Any) -> bool:
    """The model holds at least one quantized layer."""
    import mlx.nn as nn

    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
               for _, m in model.named_modules())
