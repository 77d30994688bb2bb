"""Choose how the served model's weights are held in memory (engine thread only).

On MLX's CPU backend its own quantized matmul is many times slower than float32
on OpenBLAS. So ``dtype = "auto"`` on CPU computes a quantized model's products
from its codes with the project's ``codes_matmul`` operation
(veloxquant_mlx/codes_linear.py: int8 activations, integer dot products), which
reads under a fifth of float32's bytes and makes no float32 copy. Exact float32
is an opt-in: a ``model.max_dequantized_bytes`` budget the float32 copy fits in.
Where the operation cannot be built (no cmake or C++ compiler), quantized weights
are dequantized when the copy fits half the RAM, and otherwise kept packed.

On a GPU (CUDA or Metal) it is the other way round: half-precision matmuls and
the quantized kernels are the fast paths, and memory is the scarcer resource.
So ``auto`` keeps quantized weights packed and a bfloat16/float16 checkpoint as
stored, and casts a float32 checkpoint to bfloat16 (half the bytes; bfloat16
keeps float32's exponent range, so nothing that fit in float32 overflows).

    dtype = "auto"        CPU                               GPU
    float32 checkpoint    float32                           cast to bfloat16
    bf16/fp16 checkpoint  cast to float32                   as stored
    quantized             codes (codes_matmul), float32     packed; float32 parts
                          parts; or float32 (budget)        cast to bfloat16

The float32 matrices a GGUF's Q6_K, Q3_K and Q2_K tensors became are computed from
the codes the converter kept beside them (group size 16), their float32 dropped.
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
        codes: Replace quantized layers with layers computing from their codes.
    """

    cast_to: str | None
    dequantize: bool
    note: str
    slow: bool = False
    codes: bool = False


def machine_memory_bytes() -> int:
    """Physical memory of this machine (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def dequantize_budget(max_dequantized_bytes: int, codes: bool) -> int:
    """The float32 budget in bytes: the setting; when it is 0, none where the codes
    operation serves quantized layers, else half the RAM."""
    if max_dequantized_bytes or codes:
        return max_dequantized_bytes
    return machine_memory_bytes() // 2


def float32_bytes(model: Any) -> int:
    """Bytes the model's parameters would take as float32 once dequantized."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    elements = sum(v.size for _, v in tree_flatten(model.parameters()))
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            # Swap the packed words, scales and biases for the logical weight
            # (a row is one bit stream: 5 or 6 bits do not divide a word).
            rows, words = module.weight.shape
            elements += rows * words * 32 // module.bits
            elements -= module.weight.size + module.scales.size
            elements -= module.biases.size if module.biases is not None else 0
    return elements * FLOAT32_BYTES


def plan_weights(requested: str, on_gpu: bool, quantized: bool, f32_bytes: int,
                 budget: int, stored_dtype: str, codes: bool = False) -> WeightPlan:
    """Decide cast and dequantization from the ``model.dtype`` setting.

    Args:
        requested: ``model.dtype``: auto, native, float32, float16 or bfloat16.
        on_gpu: MLX's default device is a GPU (CUDA or Metal).
        quantized: The model has quantized layers.
        f32_bytes: Size of a float32 copy of every weight.
        budget: Largest float32 copy ``auto`` may make (bytes).
        stored_dtype: The checkpoint's floating dtype (:func:`stored_float_dtype`),
            e.g. ``"bfloat16"``; for a quantized model, that of its scales and norms.
        codes: The ``codes_matmul`` operation is available (built, CPU).
    """
    if requested == "native":
        return WeightPlan(None, False, "weights as stored")
    if requested != "auto":
        kind = "packed quantized weights, float parameters" if quantized else "weights"
        return WeightPlan(requested, False, f"{kind} cast to {requested}")
    if on_gpu:
        return _plan_gpu(quantized, stored_dtype)
    if not quantized:
        return WeightPlan("float32", False, "float32 weights")
    mb, budget_mb = f32_bytes / 2**20, budget / 2**20
    if f32_bytes <= budget:
        return WeightPlan("float32", True,
                          f"quantized weights dequantized to float32 ({mb:.0f} MiB)")
    if codes:
        return WeightPlan("float32", False, "quantized weights computed from their codes "
                          "(int8 activations)", codes=True)
    return WeightPlan("float32", False,
                      f"quantized weights kept packed: a float32 copy ({mb:.0f} MiB) exceeds "
                      f"model.max_dequantized_bytes ({budget_mb:.0f} MiB), and MLX's CPU "
                      "quantized matmul is slow, so expect low tokens/s", slow=True)


def _plan_gpu(quantized: bool, stored_dtype: str) -> WeightPlan:
    """``auto`` on a GPU: half precision as stored, float32 cast to bfloat16, packed stays."""
    kind = "packed quantized weights, float32 parameters" if quantized else "float32 weights"
    if stored_dtype == "float32":
        return WeightPlan("bfloat16", False, f"{kind} cast to bfloat16 (GPU)")
    kind = "packed quantized weights" if quantized else "weights"
    return WeightPlan(None, False, f"{kind} as stored ({stored_dtype}, GPU)")


def stored_float_dtype(model: Any) -> str:
    """The floating dtype holding most of the model's parameter elements, as stored.

    Counted by elements rather than taken from the first parameter, so a float32 norm
    listed before bfloat16 weights does not decide. Packed quantized words (uint32) are
    not floating and do not count.

    Returns:
        A dtype name such as ``"bfloat16"``, or ``"unknown"`` when nothing is floating.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    counts: dict[str, int] = {}
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            name = str(value.dtype).removeprefix("mlx.core.")
            counts[name] = counts.get(name, 0) + value.size
    return max(counts, key=counts.__getitem__) if counts else "unknown"


def apply_plan(model: Any, plan: WeightPlan, group16: dict | None = None) -> int:
    """Dequantize, swap in codes layers and cast ``model`` in place as ``plan`` says, then
    materialize it.

    Args:
        model: The loaded model.
        plan: :func:`plan_weights`'s decision.
        group16: Codes of float32 matrices (``quant_weights.load_group16_parts``): with a
            codes plan those layers compute from them too.

    Returns:
        How many layers compute from codes (0 unless ``plan.codes``).
    """
    import mlx.core as mx

    layers = 0
    if plan.dequantize:
        from mlx_lm.utils import dequantize_model

        dequantize_model(model)
    if plan.cast_to is not None:
        model.set_dtype(getattr(mx, plan.cast_to))
    if plan.codes:  # after the cast, which would widen the codes layers' float16 scales
        from veloxquant_mlx.codes_linear import use_codes

        layers = use_codes(model, group16)
    mx.eval(model.parameters())
    # What the swap freed stays resident otherwise: the replaced arrays in MLX's buffer
    # cache, the repacking's temporaries in glibc's heap (286 MiB of a 1B model's load).
    from veloxquant_mlx.freed_memory import release_freed_memory

    release_freed_memory()
    return layers


def weight_bytes(model: Any) -> int:
    """Bytes the model's parameters hold (codes, scales and float parameters alike)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def is_quantized(model: Any) -> bool:
    """The model holds at least one quantized layer."""
    import mlx.nn as nn

    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
               for _, m in model.named_modules())
