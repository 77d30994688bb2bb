"""Quantized weights in the codes kernel's layout (veloxquant_mlx/quant_weights.py).

The repacking helpers are checked against MLX itself: decoding the kernel's layout
back (codes, per-group scales, shifted biases) must give exactly ``mx.dequantize``'s
weights, for 4 and 8 bits, every group size, and 2/3/5/6-bit codes widened to bytes.
What the kernel computes from that layout is tests/test_codes_matmul.py's. Last, the
default model as ``python -m server`` serves it: its layers compute from their codes,
and it still names the facts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.quant_weights import (
    GROUP,
    QuantizedParts,
    kernel_codes,
    kernel_group,
    kernel_groups,
    load_group16_parts,
    widen_to_8_bits,
)


def _has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def _quantized(group: int, bits: int, rows: int = 6, cols: int = 256, seed: int = 0):
    """mx.quantize'd random weight: its parts and ``mx.dequantize``'s float32 weight."""
    w = mx.array(np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    weight = mx.dequantize(packed, scales, biases, group_size=group, bits=bits)
    return (QuantizedParts(np.array(packed), np.array(scales), np.array(biases), group, bits),
            np.array(weight))


def _group16(rows: int = 6, cols: int = 256, seed: int = 0):
    """8-bit codes with a scale and bias per 16 columns (the GGUF converter's Q6_K/Q3_K/Q2_K
    form, which mx.quantize cannot make): parts, the codes and the weight they stand for."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.05, (rows, cols // 16)).astype(np.float32)
    biases = (rng.uniform(-0.2, 0.2, (rows, cols // 16)) - 128 * scales).astype(np.float32)
    parts = QuantizedParts(np.ascontiguousarray(codes).view("<u4"), scales, biases, 16, 8)
    weight = np.repeat(scales, 16, axis=1) * codes + np.repeat(biases, 16, axis=1)
    return parts, codes, weight.astype(np.float32)


def _kernel_codes_as_values(codes: np.ndarray, bits: int) -> np.ndarray:
    """Each column's code from the kernel's layout (signed for 8 bits), as stated in
    kernel_codes' docstring: 4 bits: per 32 columns, 16 bytes whose low nibbles are
    columns 0..15 and high nibbles 16..31; 8 bits: a byte a column, code - 128."""
    if bits == 8:
        return codes.view(np.int8).astype(np.int64)
    groups = codes.reshape(codes.shape[0], -1, GROUP // 2)
    return np.concatenate([groups & 0x0F, groups >> 4], axis=-1).reshape(
        codes.shape[0], -1).astype(np.int64)


def _decode_kernel_layout(parts: QuantizedParts) -> np.ndarray:
    """The weight the kernel's operands stand for: scale * code + bias per kernel group
    (the unsigned code: 8-bit ones are held signed, code - 128)."""
    values = _kernel_codes_as_values(kernel_codes(parts.packed, parts.bits), parts.bits)
    if parts.bits == 8:
        values = values + 128
    scales, biases = kernel_groups(parts)
    group = kernel_group(parts)
    return (values * np.repeat(scales, group, axis=1).astype(np.float64)
            + np.repeat(biases, group, axis=1).astype(np.float64))


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_layout_stands_for_mlx_dequantized_weights(bits, group):
    parts, weight = _quantized(group, bits)
    codes = kernel_codes(parts.packed, parts.bits)
    assert codes.dtype == np.uint8 and codes.shape == (6, 256 * bits // 8)
    scales, biases = kernel_groups(parts)
    assert kernel_group(parts) == GROUP  # larger groups are spread over 32 columns
    assert scales.dtype == biases.dtype == np.float32
    assert scales.shape == biases.shape == (6, 256 // GROUP)
    assert scales.flags.c_contiguous and biases.flags.c_contiguous
    np.testing.assert_allclose(_decode_kernel_layout(parts), weight, rtol=0,
                               atol=np.abs(weight).max() * 1e-6)


def test_four_bit_codes_are_split_into_nibbles_per_32_columns():
    """Column j of an MLX word sits at bits 4j; the kernel's byte i of a group holds
    columns i (low nibble) and i + 16 (high nibble)."""
    codes = (np.arange(64) % 16).astype(np.uint8)[None]  # one row, two groups
    codes[0, 32:] = 15 - codes[0, 32:]
    words = np.zeros((1, 8), np.uint32)
    for j in range(64):
        words[0, j // 8] |= np.uint32(codes[0, j]) << np.uint32(4 * (j % 8))
    got = kernel_codes(words, 4)
    assert got.shape == (1, 32)
    for g in range(2):
        for i in range(16):
            byte = int(got[0, 16 * g + i])
            assert byte & 0x0F == codes[0, 32 * g + i]
            assert byte >> 4 == codes[0, 32 * g + 16 + i]


def test_eight_bit_codes_are_signed_and_their_biases_kept():
    """The codes become int8 (q - 128); the biases stay those of the unsigned codes (the
    kernel adds 128 s in float32); 16-column groups (8 bits only) stay 16 columns."""
    parts, codes, weight = _group16()
    got = kernel_codes(parts.packed, 8)
    np.testing.assert_array_equal(got.view(np.int8).astype(np.int64), codes.astype(np.int64) - 128)
    assert kernel_group(parts) == 16
    scales, biases = kernel_groups(parts)
    np.testing.assert_array_equal(scales, parts.scales)
    np.testing.assert_array_equal(biases, parts.biases)
    np.testing.assert_allclose(_decode_kernel_layout(parts), weight, rtol=0,
                               atol=np.abs(weight).max() * 1e-6)


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_widened_codes_are_the_same_weights_at_8_bits(bits):
    """A byte a code, the scales and biases unchanged: mx.dequantize at 8 bits gives the
    very weights it gave at ``bits`` (Q5_0, Q5_1 and Q5_K layers are served this way)."""
    parts, weight = _quantized(32, bits)
    widened = widen_to_8_bits(parts.packed, bits)
    assert widened.dtype == np.uint32 and widened.shape == (6, 256 // 4)
    got = mx.dequantize(mx.array(widened), mx.array(parts.scales), mx.array(parts.biases),
                        group_size=32, bits=8)
    np.testing.assert_array_equal(np.array(got), weight)


def test_a_folder_without_sixteen_value_codes_has_none(tmp_path):
    assert load_group16_parts(tmp_path) == {}


@pytest.mark.slow
def test_the_served_default_model_computes_from_its_codes_and_answers(tmp_path: Path) -> None:
    """``python -m server`` as a user starts it: every projection and the tied embedding
    of SmolLM2's 30 layers compute from their codes, and the facts hold."""
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
    assert "computed from their codes" in started, started[-2000:]
    assert "(211 layers from codes)" in started, started[-2000:]  # 7 a layer, the embedding
    assert "Paris" in answers[0] and "Tokyo" in answers[1], answers
