"""The C SwiGLU of prompt chunks (veloxquant_mlx/swiglu.c, veloxquant_mlx/native_swiglu.py).

Checked in a child that loads the BLAS forward first (only there is the kernel loaded):
against float64 ``g * sigmoid(g) * u`` over the whole float32 range a gate takes, and
inside the tiny model, where prompt calls go through it and one-position calls do not.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.memory.test_native_attention import _run_child, needs_forward

pytestmark = pytest.mark.slow

VALUES_CHECK = textwrap.dedent(
    """
    import json
    import mlx.core as mx
    import numpy as np
    from veloxquant_mlx import native_swiglu

    rng = np.random.default_rng(5)
    gate = np.concatenate([rng.standard_normal(4093) * 6, [0.0, -0.0, 88.0, -88.0, 1e4, -1e4,
                                                          1e-30, -1e-30, 20.5, -20.5]])
    up = rng.standard_normal(gate.size)
    g, u = gate.astype(np.float32), up.astype(np.float32)
    got = np.asarray(native_swiglu.kernel_swiglu(mx.array(g), mx.array(u))).astype(np.float64)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * u64
    scale = np.maximum(np.abs(want), 1e-30)
    print(json.dumps({"max_rel": float((np.abs(got - want) / scale)[np.abs(want) > 1e-30].max()),
                      "finite": bool(np.isfinite(got).all()),
                      "odd_tail": float(abs(got[-1] - want[-1]) / abs(want[-1]))}))
    """
)

MODEL_CHECK = textwrap.dedent(
    """
    import json, sys
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache
    from veloxquant_mlx import native_swiglu
    from veloxquant_mlx.llama_model import own_model

    stock, _ = mlx_lm.load(sys.argv[1])
    prompt = mx.array([[5 + (7 * j) % 900 for j in range(37)]])
    cache = make_prompt_cache(stock)
    want = stock(prompt, cache=cache)[0, -1]
    want_next = stock(mx.array([[17]]), cache=cache)[0, -1]
    model = own_model(stock)
    calls = []
    kernel_swiglu = native_swiglu.kernel_swiglu
    def counting(gate, up):
        calls.append(gate.shape[1])
        return kernel_swiglu(gate, up)
    native_swiglu.kernel_swiglu = counting
    cache = make_prompt_cache(model)
    got = model(prompt, cache=cache)[0, -1]
    prompt_calls = list(calls)
    got_next = model(mx.array([[17]]), cache=cache)[0, -1]
    rel = lambda a, b: float(mx.abs(a - b).max() / mx.abs(b).max())
    print(json.dumps({"kernel": native_swiglu.kernel() is not None,
                      "prompt_calls": prompt_calls, "decode_calls": calls[len(prompt_calls):],
                      "layers": len(model.layers), "prompt_error": rel(got, want),
                      "next_error": rel(got_next, want_next)}))
    """
)


@needs_forward
def test_kernel_is_silu_times_up_within_float32_rounding() -> None:
    report = _run_child(VALUES_CHECK)
    assert report["finite"]
    assert report["max_rel"] < 1e-6, report
    assert report["odd_tail"] < 1e-6  # the scalar tail past the last 8-wide step


@needs_forward
def test_prompt_calls_take_the_kernel_and_decode_calls_do_not(tiny_model_path) -> None:
    report = _run_child(MODEL_CHECK, str(tiny_model_path))
    assert report["kernel"]
    assert report["prompt_calls"] == [37] * report["layers"]
    assert report["decode_calls"] == []
    assert report["prompt_error"] < 1e-5 and report["next_error"] < 1e-5, report


def test_without_the_preload_mlx_lms_swiglu_runs(tiny_model_path) -> None:
    report = _run_child(MODEL_CHECK, str(tiny_model_path), preload=False)
    assert not report["kernel"]
    assert report["prompt_calls"] == [] and report["prompt_error"] == 0.0

