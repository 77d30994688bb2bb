"""model_weights: what ``model.dtype`` does to the weights on a CPU and on a GPU.

``plan_weights`` is pure; ``stored_float_dtype`` and ``apply_plan`` run on small real MLX
modules (MLX's CPU backend here; the plan, not the device, decides what they do).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from server.model_weights import WeightPlan, apply_plan, plan_weights, stored_float_dtype

MiB = 2**20


def plan(requested: str = "auto", *, on_gpu: bool, quantized: bool = False,
         stored: str = "float32", f32_bytes: int = 10 * MiB, budget: int = 100 * MiB
         ) -> WeightPlan:
    return plan_weights(requested, on_gpu, quantized, f32_bytes, budget, stored_dtype=stored)


def test_gpu_casts_a_float32_checkpoint_to_bfloat16() -> None:
    assert plan(on_gpu=True, stored="float32") == WeightPlan(
        "bfloat16", False, "float32 weights cast to bfloat16 (GPU)")


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_gpu_keeps_a_half_precision_checkpoint_as_stored(stored: str) -> None:
    assert plan(on_gpu=True, stored=stored) == WeightPlan(
        None, False, f"weights as stored ({stored}, GPU)")


def test_gpu_keeps_quantized_weights_packed() -> None:
    assert plan(on_gpu=True, quantized=True, stored="bfloat16") == WeightPlan(
        None, False, "packed quantized weights as stored (bfloat16, GPU)")
    # float32 scales, biases and norms go to bfloat16; the packed words are not floating.
    assert plan(on_gpu=True, quantized=True, stored="float32") == WeightPlan(
        "bfloat16", False, "packed quantized weights, float32 parameters cast to bfloat16 (GPU)")


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
def test_cpu_auto_is_float32_whatever_is_stored(stored: str) -> None:
    assert plan(on_gpu=False, stored=stored) == WeightPlan("float32", False, "float32 weights")


def test_cpu_auto_dequantizes_within_the_budget_and_warns_beyond_it() -> None:
    fits = plan(on_gpu=False, quantized=True, stored="bfloat16", f32_bytes=50 * MiB)
    assert (fits.cast_to, fits.dequantize, fits.slow) == ("float32", True, False)
    assert fits.note == "quantized weights dequantized to float32 (50 MiB)"
    over = plan(on_gpu=False, quantized=True, stored="bfloat16", f32_bytes=500 * MiB)
    assert (over.cast_to, over.dequantize, over.slow) == ("float32", False, True)
    assert "exceeds model.max_dequantized_bytes (100 MiB)" in over.note


@pytest.mark.parametrize("on_gpu", [False, True])
def test_explicit_and_native_settings_ignore_the_device_and_the_stored_dtype(on_gpu: bool) -> None:
    assert plan("native", on_gpu=on_gpu) == WeightPlan(None, False, "weights as stored")
    assert plan("float16", on_gpu=on_gpu, stored="bfloat16") == WeightPlan(
        "float16", False, "weights cast to float16")
    assert plan("float32", on_gpu=on_gpu, quantized=True) == WeightPlan(
        "float32", False, "packed quantized weights, float parameters cast to float32")


class _Block(nn.Module):
    """A float32 norm listed before a larger Linear, as in a transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(64)
        self.proj = nn.Linear(64, 128)


def test_stored_dtype_is_the_dtype_of_most_elements() -> None:
    block = _Block()
    block.proj.set_dtype(mx.bfloat16)
    assert block.norm.weight.dtype == mx.float32  # the first parameter does not decide
    assert stored_float_dtype(block) == "bfloat16"
    block.set_dtype(mx.float16)
    assert stored_float_dtype(block) == "float16"


def test_stored_dtype_of_a_quantized_model_ignores_the_packed_words() -> None:
    block = _Block()
    block.set_dtype(mx.bfloat16)
    nn.quantize(block, group_size=32, bits=4)
    assert block.proj.weight.dtype == mx.uint32
    assert stored_float_dtype(block) == "bfloat16"
    assert stored_float_dtype(nn.Module()) == "unknown"


def test_gpu_plan_for_a_float32_quantized_model_leaves_the_packed_words_alone() -> None:
    block = _Block()
    nn.quantize(block, group_size=32, bits=4)  # float32 scales and biases
    chosen = plan(on_gpu=True, quantized=True, stored=stored_float_dtype(block))
    apply_plan(block, chosen)
    assert block.proj.weight.dtype == mx.uint32
    assert block.proj.scales.dtype == mx.bfloat16 and block.norm.weight.dtype == mx.bfloat16
    assert stored_float_dtype(block) == "bfloat16"
