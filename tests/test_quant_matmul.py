"""Quantized copies (veloxquant_mlx/quant_matmul.c, quant_weights.py) inside MLX's matmuls.

Each check runs in a child that loads the BLAS forward first, as the server does. The
kernel's result is compared with a NumPy float64 emulation of what it promises (x rounded
to int8 per group of 32, the weights' own codes, scales and biases, one of each per 16, 32
or more columns): that pins down the code layout, the per-group scales and the bias term
to float rounding. Against the exact
float32 product it is only close (the int8 rounding), which is checked separately.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from veloxquant_mlx import cpu_backend as cb


def _has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


LIB = cb.find_optimized_blas()
FORWARD = cb.find_sgemv_forward()
pytestmark = pytest.mark.skipif(
    LIB is None or FORWARD is None or not _has_avx2_fma(),
    reason="needs OpenBLAS (scipy-openblas32 or a distribution's), the BLAS forward that "
    "`pip install -e .` builds, and AVX2+FMA",
)

EMULATE = textwrap.dedent(
    """
    import numpy as np

    def codes_of(packed, bits, cols):
        per_word = 32 // bits
        j = np.arange(cols)
        return (packed[:, j // per_word] >> (bits * (j % per_word))) & ((1 << bits) - 1)

    def emulate(x, packed, scales, biases, group, bits):
        '''What quant_matmul.c computes, in float64, from its documented math.'''
        rows, cols = packed.shape[0], x.shape[1]
        offset = 128 if bits == 8 else 0  # 8-bit codes are held signed, biases shifted
        q = codes_of(packed.astype(np.int64), bits, cols) - offset
        s = np.repeat(scales, group // 16, axis=1).astype(np.float64)  # per 16 columns
        b = np.repeat(biases, group // 16, axis=1).astype(np.float64) + offset * s
        xg = x.reshape(x.shape[0], -1, 32)  # x's int8 scale: one per 32 columns
        amax = np.abs(xg).max(axis=2, keepdims=True)
        inv = np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32)
        xq = np.rint((xg * inv).astype(np.float32)).astype(np.int64).reshape(len(x), -1, 16)
        d = np.repeat((amax / np.float32(127)).astype(np.float32)[..., 0], 2, axis=1)
        # The bias term takes x as rounded (d * sum q), so a product is w times that x.
        sums = xq.sum(axis=2) * d.astype(np.float64)
        dots = np.einsum("rgk,ngk->rng", xq, q.reshape(rows, -1, 16)).astype(np.float64)
        return (dots * d.astype(np.float64)[:, None, :] * s[None]).sum(axis=2) + sums @ b.T

    def sixteens(rng, rows, cols):
        '''Random 8-bit codes with a scale and bias per 16 columns (as the GGUF converter
        keeps Q6_K/Q3_K/Q2_K, which mx.quantize cannot make): packed, scales, biases.'''
        codes = rng.integers(96, 160, (rows, cols), dtype=np.uint8)  # Q6_K's range
        scales = rng.uniform(0.01, 0.05, (rows, cols // 16)).astype(np.float32)
        biases = (rng.uniform(-0.2, 0.2, (rows, cols // 16)) - 128 * scales).astype(np.float32)
        return np.ascontiguousarray(codes).view(np.uint32), scales, biases
    """
)

KERNEL_CHECK = EMULATE + textwrap.dedent(
    """
    import json
    import mlx.core as mx
    from veloxquant_mlx.quant_weights import (QuantizedCopies, QuantizedCopyError,
                                              QuantizedParts, quant_library)

    lib = quant_library()
    assert lib is not None, "the forward is not loaded"
    rng = np.random.default_rng(7)
    report = {"cases": []}
    from veloxquant_mlx.quant_weights import widen_to_8_bits
    for bits, group in ((4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 16), (5, 32)):
        rows, cols = 72, 384
        widened = bits == 5
        if widened:  # a GGUF Q5_0/Q5_1 layer: its codes widened to a byte, as served
            w = mx.array(rng.standard_normal((rows, cols)).astype(np.float32))
            packed, scales, biases = mx.quantize(w, group_size=group, bits=5)
            weight = mx.dequantize(packed, scales, biases, group_size=group, bits=5)
            packed, bits = mx.array(widen_to_8_bits(np.array(packed), 5)), 8
        elif group == 16:
            packed, scales, biases = (mx.array(a) for a in sixteens(rng, rows, cols))
            weight = (mx.repeat(scales, 16, axis=1) * mx.array(codes_of(
                np.array(packed).astype(np.int64), 8, cols).astype(np.float32))
                + mx.repeat(biases, 16, axis=1))
        else:
            w = mx.array(rng.standard_normal((rows, cols)).astype(np.float32))
            packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
            weight = mx.dequantize(packed, scales, biases, group_size=group, bits=bits)
        weight = weight.astype(mx.float32)
        mx.eval(weight)
        parts = QuantizedParts(np.array(packed), np.array(scales.astype(mx.float32)),
                               np.array(biases.astype(mx.float32)), group, bits)
        copies = QuantizedCopies(lib, max_rows=16)
        copies.add(weight, parts)
        exact_w = np.array(weight).astype(np.float64)
        for m in (1, 3, 4, 7, 16, 17):
            x = rng.standard_normal((m, cols)).astype(np.float32)
            before = copies.served()
            got = np.array(mx.array(x) @ weight.T).astype(np.float64)
            exact = x.astype(np.float64) @ exact_w.T
            want = emulate(x, parts.packed, parts.scales, parts.biases, group, bits)
            scale = np.abs(exact).max()
            report["cases"].append({
                "bits": bits, "group": group, "m": m, "widened": bool(widened),
                "served": copies.served() - before,
                "vs_emulation": float(np.abs(got - want).max() / scale),
                "vs_exact": float(np.abs(got - exact).max() / scale)})
        copies.close()
        x = rng.standard_normal((1, cols)).astype(np.float32)
        before = copies.served()
        got = np.array(mx.array(x) @ weight.T).astype(np.float64)
        exact = x.astype(np.float64) @ exact_w.T
        report.setdefault("after_close", []).append({
            "served": copies.served() - before,
            "vs_exact": float(np.abs(got - exact).max() / np.abs(exact).max())})

    errors = []
    copies = QuantizedCopies(lib, max_rows=16)
    bad = mx.zeros((8, 40), mx.float32)  # 40 columns: not whole groups of 32
    for weight, parts in (
            (bad, QuantizedParts(np.zeros((8, 5), np.uint32), np.ones((8, 1), np.float32),
                                 np.zeros((8, 1), np.float32), 40, 4)),
            (mx.zeros((8, 64), mx.float16),
             QuantizedParts(np.zeros((8, 8), np.uint32), np.ones((8, 2), np.float32),
                            np.zeros((8, 2), np.float32), 32, 4)),
            (mx.zeros((8, 64), mx.float32),
             QuantizedParts(np.zeros((8, 4), np.uint32), np.ones((8, 2), np.float32),
                            np.zeros((8, 2), np.float32), 32, 4)),
            (mx.zeros((8, 64), mx.float32),  # 16 columns a scale: 8-bit codes only
             QuantizedParts(np.zeros((8, 8), np.uint32), np.ones((8, 4), np.float32),
                            np.zeros((8, 4), np.float32), 16, 4))):
        try:
            copies.add(weight, parts)
            errors.append("accepted")
        except QuantizedCopyError as exc:
            errors.append(str(exc))
    report["errors"] = errors
    report["registered_after_errors"] = len(copies)

    import mlx.nn as nn
    from veloxquant_mlx.quant_weights import attach_quantized_copies
    layer = nn.Linear(64, 8, bias=False)
    mx.eval(layer.parameters())
    wrong = QuantizedParts(np.zeros((8, 4), np.uint32), np.ones((8, 1), np.float32),
                           np.zeros((8, 1), np.float32), 32, 4)  # 32 columns, not 64
    report["attach_refused"] = attach_quantized_copies(lib, layer, {"": wrong}, 16) is None
    print(json.dumps(report))
    """
)


def _run_child(script: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """Run ``script`` after loading the forward (``env`` added); its last line's JSON."""
    extra = env or {}
    env = cb.child_env(preload=True, base=dict(os.environ))
    env.update(extra)
    env.pop(cb.FORWARD_OPT_OUT_ENV, None)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", cb.LOAD_FIRST + script, *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def kernel_report() -> dict:
    return _run_child(KERNEL_CHECK)


# A widened 5-bit layer's products against the exact float64 ones (relative to the largest):
# 0.004-0.006 with the bias term on x as rounded; 0.064-0.068 with it on the exact sums
# (measured in the same NumPy emulation).
WIDENED_LIMIT = 1.5e-2


def test_products_follow_the_documented_int8_math_for_4_and_8_bits(kernel_report) -> None:
    """Every case, 16-column scales (8-bit) included; a swap of a 16-column pair's scales
    or a bias term over 32-column sums would miss the emulation by far more than 1e-5."""
    report = kernel_report
    assert {(c["bits"], c["group"]) for c in report["cases"]} >= {(8, 16), (4, 32), (8, 32)}
    for case in report["cases"]:
        if case["m"] <= 16:  # served from the codes: exactly the emulated int8 product
            assert case["served"] == 1, case
            assert case["vs_emulation"] < 1e-5, case
            assert case["vs_exact"] < 3e-2, case  # only x's int8 rounding
            if case["widened"]:
                # Codes near -112 once signed: the bias term must use x as rounded, or
                # x's rounding error comes back multiplied by them.
                assert case["vs_exact"] < WIDENED_LIMIT, case
        else:  # above max_rows: OpenBLAS on the float32 weight
            assert case["served"] == 0, case
            assert case["vs_exact"] < 1e-5, case
    for after in report["after_close"]:  # unregistered: the float32 path again
        assert after["served"] == 0 and after["vs_exact"] < 1e-5, after


def test_copies_that_cannot_be_served_are_refused_with_the_reason(kernel_report) -> None:
    errors = kernel_report["errors"]
    assert "not a multiple of 32" in errors[0]
    assert "float32" in errors[1] and "float16" in errors[1]
    assert "does not match" in errors[2]
    assert "16 for 8 bits" in errors[3]
    assert kernel_report["registered_after_errors"] == 0
    # Loading goes on without the copies when one is refused (logged; float32 serves).
    assert kernel_report["attach_refused"]


MODEL_CHECK = textwrap.dedent(
    """
    import json, sys
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from server.model_weights import WeightPlan, apply_plan

    model, _ = mlx_lm.load(sys.argv[1])
    nn.quantize(model, group_size=32, bits=4)
    copies = apply_plan(model, WeightPlan("float32", True, "dequantized"), quantized_rows=16)
    prompt = mx.array([[5, 17, 300, 42, 9, 77, 1000, 12] * 5])  # 40 tokens: past 16 rows

    def run():
        cache = make_prompt_cache(model)
        before = copies.served()
        prefill = model(prompt, cache=cache)[0, -1]
        mx.eval(prefill)
        prefill_served = copies.served() - before
        step = model(mx.array([[int(mx.argmax(prefill))]]), cache=cache)[0, -1]
        mx.eval(step)
        return (np.array(prefill), np.array(step), prefill_served,
                copies.served() - before - prefill_served)

    prefill_q, step_q, prefill_served, step_served = run()
    n = len(copies)
    copies.close()
    prefill_f, step_f, _, step_served_after = run()
    print(json.dumps({
        "registered": n, "layers": len(model.layers),
        "prefill_served": prefill_served, "step_served": step_served,
        "step_served_after_close": step_served_after,
        "prefill_diff": float(np.abs(prefill_q - prefill_f).max()),
        "step_diff": float(np.abs(step_q - step_f).max()),
        "logit_scale": float(np.abs(step_f).max()),
        "same_next_token": int(np.argmax(step_q)) == int(np.argmax(step_f))}))
    """
)


def test_a_dequantized_model_decodes_from_its_codes(tiny_model_path: Path) -> None:
    report = _run_child(MODEL_CHECK, str(tiny_model_path))
    # q, k, v, o, gate, up, down per layer, plus the embedding (tied head or lm_head).
    assert report["registered"] >= 7 * report["layers"] + 1, report
    assert report["prefill_served"] == 0, report  # 40 rows: OpenBLAS, float32
    assert report["prefill_diff"] == 0.0, report
    assert report["step_served"] >= 7 * report["layers"], report  # one row: the codes
    assert report["step_served_after_close"] == 0, report
    assert 0.0 < report["step_diff"] < 0.05 * report["logit_scale"], report


def test_the_served_default_model_decodes_from_its_codes_and_answers(tmp_path: Path) -> None:
    """``python -m server`` as a user starts it: the codes serve decode, the facts hold."""
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark_scripts"))
    from server_process import ServerProcess

    log = tmp_path / "smollm2.log"
    with ServerProcess(log, ["--model", "smollm2"], startup_timeout_s=300) as server:
        answers = []
        for question in ("What is the capital of France? Answer in one sentence.",
                         "What is the capital of Japan? Answer in one sentence."):
            body = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 24,
                    "messages": [{"role": "user", "content": question}]}
            resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            answers.append(resp.json()["choices"][0]["message"]["content"])
    started = log.read_text()
    assert "from the quantized codes of 211 matrices" in started, started[-2000:]
    assert "Paris" in answers[0] and "Tokyo" in answers[1], answers
