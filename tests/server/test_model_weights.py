"""model_weights: what ``model.dtype`` does to the weights on a CPU and on a GPU.

``plan_weights`` is pure; ``stored_float_dtype`` and ``apply_plan`` run on small real MLX
modules (MLX's CPU backend here; the plan, not the device, decides what they do). On a CPU a
quantized model computes from its codes (veloxquant_mlx/codes_linear.py) unless a
``model.max_dequantized_bytes`` budget holds its float32 copy.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from server.model_weights import (
    WeightPlan,
    apply_plan,
    dequantize_budget,
    float32_bytes,
    machine_memory_bytes,
    plan_weights,
    stored_float_dtype,
    weight_bytes,
)

MiB = 2**20


def plan(requested: str = "auto", *, on_gpu: bool, quantized: bool = False,
         stored: str = "float32", f32_bytes: int = 10 * MiB, budget: int = 100 * MiB,
         codes: bool = False) -> WeightPlan:
    return plan_weights(requested, on_gpu, quantized, f32_bytes, budget, stored_dtype=stored,
                        codes=codes)


def _codes_op_or_skip() -> None:
    from veloxquant_mlx.kernels.build import KernelBuildError, load

    try:
        load()
    except KernelBuildError as exc:
        pytest.skip(f"the codes_matmul extension cannot be built here: {exc}")


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
    """Without the codes operation (no cmake or C++ compiler to build it)."""
    fits = plan(on_gpu=False, quantized=True, stored="bfloat16", f32_bytes=50 * MiB)
    assert (fits.cast_to, fits.dequantize, fits.slow, fits.codes) == (
        "float32", True, False, False)
    assert fits.note == "quantized weights dequantized to float32 (50 MiB)"
    over = plan(on_gpu=False, quantized=True, stored="bfloat16", f32_bytes=500 * MiB)
    assert (over.cast_to, over.dequantize, over.slow, over.codes) == (
        "float32", False, True, False)
    assert "exceeds model.max_dequantized_bytes (100 MiB)" in over.note


def test_cpu_auto_computes_from_the_codes_without_a_budget() -> None:
    """The default (max_dequantized_bytes 0: budget 0 with the operation built)."""
    chosen = plan(on_gpu=False, quantized=True, stored="bfloat16", f32_bytes=50 * MiB,
                  budget=dequantize_budget(0, True), codes=True)
    assert (chosen.cast_to, chosen.dequantize, chosen.slow, chosen.codes) == (
        "float32", False, False, True)
    assert chosen.note.startswith("quantized weights computed from their codes")
    # Beyond an explicit budget too: the codes need no float32 copy.
    over = plan(on_gpu=False, quantized=True, f32_bytes=500 * MiB, codes=True)
    assert over.codes and not over.slow and not over.dequantize


def test_a_budget_that_holds_the_float32_copy_opts_in_to_exact_float32() -> None:
    chosen = plan(on_gpu=False, quantized=True, stored="bfloat16", f32_bytes=50 * MiB,
                  budget=dequantize_budget(100 * MiB, True), codes=True)
    assert chosen == WeightPlan("float32", True,
                                "quantized weights dequantized to float32 (50 MiB)")


def test_codes_never_apply_off_the_cpu_auto_path() -> None:
    """A float model, a GPU, and an explicit dtype ignore ``codes``."""
    assert not plan(on_gpu=False, codes=True, budget=0).codes
    assert not plan(on_gpu=True, quantized=True, codes=True, budget=0).codes
    assert not plan("float32", on_gpu=False, quantized=True, codes=True, budget=0).codes
    assert not plan("native", on_gpu=False, quantized=True, codes=True, budget=0).codes


def test_the_budget_is_the_setting_else_none_with_codes_else_half_the_ram() -> None:
    assert dequantize_budget(0, True) == 0
    assert dequantize_budget(5, True) == 5
    assert dequantize_budget(5, False) == 5
    assert dequantize_budget(0, False) == machine_memory_bytes() // 2
    assert dequantize_budget(0, False) > 0


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


def test_a_codes_plan_swaps_quantized_layers_for_codes_layers() -> None:
    """The CPU default for a quantized model: no QuantizedLinear left, no float32 copy of
    the weight; the output is the quantized layer's up to the activations' int8 rounding."""
    _codes_op_or_skip()
    from veloxquant_mlx.codes_linear import CodesLinear

    block = _Block()
    block.set_dtype(mx.bfloat16)
    nn.quantize(block, group_size=32, bits=4)
    x = mx.random.normal((3, 64), key=mx.random.key(0))
    want = np.array(block.proj(x.astype(mx.bfloat16)).astype(mx.float32))
    f32 = float32_bytes(block)
    chosen = plan(on_gpu=False, quantized=True, stored=stored_float_dtype(block),
                  f32_bytes=f32, budget=dequantize_budget(0, True), codes=True)
    assert apply_plan(block, chosen) == 1
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for _, m in block.named_modules())
    assert isinstance(block.proj, CodesLinear) and block.proj.weight.dtype == mx.uint8
    assert block.norm.weight.dtype == mx.float32  # float parameters cast as planned
    assert block.proj.bias.dtype == mx.float32
    assert weight_bytes(block) < f32 / 3  # 4-bit codes, a float32 scale and bias per 32
    got = np.array(block.proj(x))
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max()


def test_a_codes_plan_serves_sixteen_value_matrices_from_their_codes() -> None:
    """A GGUF's Q6_K matrix arrives float32 with group-16 codes beside it (load_group16_parts):
    it becomes a codes layer too, and its float32 weight is dropped."""
    _codes_op_or_skip()
    from veloxquant_mlx.codes_linear import CodesLinear
    from veloxquant_mlx.quant_weights import QuantizedParts

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (128, 64), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.05, (128, 4)).astype(np.float32)
    biases = (rng.uniform(-0.2, 0.2, (128, 4)) - 128 * scales).astype(np.float32)
    block = _Block()
    block.proj.weight = mx.array(np.repeat(scales, 16, axis=1) * codes
                                 + np.repeat(biases, 16, axis=1))
    x = mx.random.normal((3, 64), key=mx.random.key(0))
    want = np.array(block.proj(x))
    parts = {"proj": QuantizedParts(np.ascontiguousarray(codes).view("<u4"), scales, biases,
                                    16, 8)}
    chosen = WeightPlan("float32", False, "codes", codes=True)
    assert apply_plan(block, chosen, group16=parts) == 1
    assert isinstance(block.proj, CodesLinear) and block.proj.group == 16
    got = np.array(block.proj(x))
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max()
    # Without a codes plan the group-16 codes are left unused.
    other = _Block()
    assert apply_plan(other, WeightPlan("float32", False, "float32 weights"),
                      group16=parts) == 0
    assert type(other.proj) is nn.Linear
