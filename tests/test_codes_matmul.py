"""The ``codes_matmul`` MLX operation (veloxquant_mlx/kernels) and the layers built on it.

The kernel promises one thing exactly: the product of the dequantized weights and x
rounded to int8 per group of 32 columns (scale max|x|/127, round half to even). A NumPy
float64 emulation of that pins down the code layouts, per-group scales and the bias term
to float32 rounding (~1e-5 relative); against the plain float product it is only close
(the int8 rounding, ~0.5%), checked separately with a 2% bound. Both the AVX2 path and
the portable C path are checked, as are batch invariance (a row's result does not depend
on the other rows), input validation, and the layers that swap into an mlx-lm model.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from veloxquant_mlx.codes_linear import CodesEmbedding, CodesLinear, layer_parts, use_codes
from veloxquant_mlx.kernels.build import KernelBuildError, build, build_tag, cache_root, load
from veloxquant_mlx.quant_weights import (
    QuantizedParts,
    kernel_codes,
    kernel_group,
    kernel_groups,
    widen_to_8_bits,
)

try:
    EXT = load()
except KernelBuildError as exc:  # no cmake / C++ compiler / nanobind here
    pytest.skip(f"the codes_matmul extension cannot be built here: {exc}",
                allow_module_level=True)

AVX2 = EXT.kernel_path() == "avx2"
ROWS = 100  # not a multiple of 8: the threads' split of weight rows has a ragged end
# Columns per (mx.quantize) group size; 480 = 15 groups of 32, an odd count, so the
# AVX2 loop's two-group step leaves a tail.
COLS = {32: 480, 64: 448, 128: 384}
M_VALUES = (1, 3, 4, 5, 17, 64)


# ------------------------------------------------------------------ helpers


def round_x(x: np.ndarray) -> np.ndarray:
    """x (m x cols float32) as the kernel rounds it, in float64: per group of 32,
    q = rint(x * (127 / amax)) in float32 (half to even), value q * (amax / 127)."""
    xg = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(xg).max(axis=2, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(xg * inv)
    d = amax / np.float32(127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def emulate(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """What the kernel promises: the dequantized weight times x's int8 rounding."""
    return round_x(x) @ weight.astype(np.float64).T


def rel_err(got, want) -> float:
    """Largest absolute difference, relative to the reference's largest magnitude."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def kernel_weight(parts: QuantizedParts) -> np.ndarray:
    """The weight the kernel computes with (float64): its codes, scales and biases (given
    to it as float32 here, so used as they are)."""
    codes = kernel_codes(parts.packed, parts.bits)
    scales, biases = kernel_groups(parts)
    rows = codes.shape[0]
    if parts.bits == 4:  # per 32 columns: low nibbles 0-15, high nibbles 16-31
        halves = codes.reshape(rows, -1, 16)
        q = np.concatenate([halves & 0x0F, halves >> 4], axis=-1).reshape(rows, -1)
    else:  # signed bytes, code - 128
        q = codes.view(np.int8).astype(np.int64) + 128
    group = kernel_group(parts)

    def spread(values: np.ndarray) -> np.ndarray:
        return np.repeat(values.astype(np.float64), group, axis=1)

    return spread(scales) * q.astype(np.float64) + spread(biases)


def quantized(rows: int, cols: int, group: int, bits: int, seed: int = 0):
    """mx.quantize'd random weight: (parts, the weight the kernel holds, as numpy)."""
    w = mx.array(np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    parts = QuantizedParts(np.array(wq), np.array(s), np.array(b), group, bits)
    return parts, kernel_weight(parts)


def operands(parts: QuantizedParts):
    """The kernel's (codes, scales, biases) arrays and its group, from ``parts``."""
    scales, biases = kernel_groups(parts)
    return (mx.array(kernel_codes(parts.packed, parts.bits)), mx.array(scales),
            mx.array(biases), kernel_group(parts))


def matmul(x, parts: QuantizedParts, portable: bool = False) -> np.ndarray:
    codes, scales, biases, group = operands(parts)
    x = x if isinstance(x, mx.array) else mx.array(x)
    return np.array(EXT.codes_matmul(x, codes, scales, biases, bits=parts.bits, group=group,
                                     portable=portable))


def group16(rows: int, cols: int, seed: int = 0):
    """8-bit codes with a scale and bias per 16 columns, built by hand (mx.quantize cannot
    make them): (parts, the weight the kernel holds)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[0, :4] = (0, 255, 128, 127)  # the ends of the range and both sides of 128
    scales = rng.uniform(0.002, 0.02, (rows, cols // 16)).astype(np.float32)
    biases = (rng.uniform(-0.3, 0.3, (rows, cols // 16)) - 128 * scales).astype(np.float32)
    packed = np.ascontiguousarray(codes).view("<u4")  # 4 codes a word, lowest byte first
    assert packed.shape == (rows, cols // 4)
    parts = QuantizedParts(packed, scales, biases, 16, 8)
    return parts, kernel_weight(parts)


def activations(m: int, cols: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, cols)).astype(np.float32)


PATHS = [pytest.param(False, id="auto"), pytest.param(True, id="portable")]


# ------------------------------------------------------------------ correctness


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_matches_int8_emulation_and_float_product(bits, group, portable):
    """Every m (one row, a block of four, a ragged tail, threaded sizes) equals the
    emulation to float32 rounding, and the float product to the int8 rounding's ~0.5%:
    the code layout, the scales spread over 32 columns and the bias term are right."""
    cols = COLS[group]
    parts, weight = quantized(ROWS, cols, group, bits)
    for m in M_VALUES:
        x = activations(m, cols, seed=m)
        got = matmul(x, parts, portable)
        assert got.shape == (m, ROWS) and got.dtype == np.float32
        assert rel_err(got, emulate(x, weight)) < 1e-5, m
        exact = x.astype(np.float64) @ weight.astype(np.float64).T
        assert rel_err(got, exact) < 0.02, m


@pytest.mark.parametrize("portable", PATHS)
def test_rounding_ties_to_even_and_zero_groups(portable):
    """x chosen so x * 127/amax lands exactly on halves (amax = 127: the factor is 1)
    rounds half to even, as cvtps does (half away from zero would move 0.5 to 1); a group
    of zeros (amax 0) contributes nothing rather than NaN."""
    cols = 96
    parts, weight = quantized(40, cols, 32, 8)
    x = np.zeros((2, cols), np.float32)
    x[0, :32] = np.resize([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -126.5], 32)
    x[0, 64:] = np.resize([-127.0, 4.5, -5.5, 0.5], 32)  # group 1 stays all zeros
    x[1, 32:64] = np.resize([127.0, 6.5, -7.5, 8.5], 32)
    got = matmul(x, parts, portable)
    assert np.isfinite(got).all()
    want = emulate(x, weight)
    assert rel_err(got, want) < 1e-5
    # The emulation's rounding is the one claimed: rint on these halves is half to even.
    assert np.array_equal(round_x(x)[0, :8], [127, 0, 2, 2, 0, -2, 4, -126])


@pytest.mark.parametrize("portable", PATHS)
def test_eight_bit_codes_with_16_column_groups(portable):
    """8-bit codes with a scale and bias per 16 columns (GGUF's Q6_K/Q3_K/Q2_K), over the
    whole code range 0..255, equal the emulation of their NumPy dequantization."""
    cols = 480
    parts, weight = group16(ROWS, cols)
    assert kernel_group(parts) == 16
    for m in (1, 4, 7, 33):
        x = activations(m, cols, seed=m)
        got = matmul(x, parts, portable)
        assert rel_err(got, emulate(x, weight)) < 1e-5, m
        assert rel_err(got, x.astype(np.float64) @ weight.astype(np.float64).T) < 0.02, m


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_widened_codes_served_as_8_bits(bits, group):
    """A 2/3/5/6-bit QuantizedLinear, widened to a byte a code by layer_parts
    (widen_to_8_bits), gives the product of its own dequantized weights.

    Served as 8 bits, a code q becomes q - 128 and its bias b + 128 s, so at few bits the
    integer and bias terms are ~128 / 2**bits times the result and cancel: float32
    rounding grows to ~2e-5 at 2 bits (~3e-7 at 4 and 8), hence the looser bound there."""
    mx.random.seed(bits)
    layer = nn.QuantizedLinear.from_linear(nn.Linear(320, 72, bias=False),
                                           group_size=group, bits=bits)
    parts = layer_parts(layer)
    assert parts is not None and parts.bits == 8 and parts.group_size == group
    weight = np.array(mx.dequantize(layer.weight, layer.scales, layer.biases,
                                    group_size=group, bits=bits))
    # The widening itself keeps every code: dequantizing the bytes gives the same weight.
    as_bytes = np.array(mx.dequantize(mx.array(widen_to_8_bits(np.array(layer.weight), bits)),
                                      layer.scales, layer.biases, group_size=group, bits=8))
    assert np.array_equal(as_bytes, weight)
    for m in (1, 5):
        x = activations(m, 320, seed=m)
        for portable in (False, True):
            got = matmul(x, parts, portable)
            assert rel_err(got, emulate(x, kernel_weight(parts))) < \
                (1e-4 if bits <= 3 else 1e-5), (m, portable)
        assert rel_err(got, np.array(layer(mx.array(x)))) < 0.02


def test_smallest_shape():
    """One weight row of 32 columns (one group: no pair of groups at all) works."""
    for bits in (4, 8):
        parts, weight = quantized(1, 32, 32, bits)
        x = activations(3, 32)
        for portable in (False, True):
            got = matmul(x, parts, portable)
            assert got.shape == (3, 1)
            assert rel_err(got, emulate(x, weight)) < 1e-5, (bits, portable)


# ------------------------------------------------------------------ paths and batches


@pytest.mark.parametrize("case", ["4bit", "8bit", "8bit-g16"])
def test_batch_invariance(case):
    """Each row of a 17-row product (four blocks of four and a tail row) is bit-identical
    to the same row computed alone, and to the rows' product in another order: a row's
    result never depends on which rows share the call (so batching leaves outputs alone)."""
    cols = 480
    parts = group16(ROWS, cols)[0] if case == "8bit-g16" else \
        quantized(ROWS, cols, 32, 4 if case == "4bit" else 8)[0]
    x = activations(17, cols, seed=3)
    full = matmul(x, parts)
    for r in range(17):
        assert np.array_equal(matmul(x[r:r + 1], parts)[0], full[r]), r
    order = np.random.default_rng(0).permutation(17)
    assert np.array_equal(matmul(x[order], parts), full[order])
    assert np.array_equal(matmul(x[5:11], parts), full[5:11])


@pytest.mark.skipif(not AVX2, reason="this CPU takes the portable path only")
@pytest.mark.parametrize("case", ["4bit", "8bit", "8bit-g16"])
def test_avx2_and_portable_paths_agree(case):
    """The AVX2 path computes the same integer sums as the plain C loop; only the float
    summation order differs."""
    cols = 448
    parts = group16(ROWS, cols)[0] if case == "8bit-g16" else \
        quantized(ROWS, cols, 32, 4 if case == "4bit" else 8)[0]
    x = activations(9, cols, seed=4)
    assert rel_err(matmul(x, parts), matmul(x, parts, portable=True)) < 1e-5


def test_leading_dims_dtypes_and_views():
    """x of shape (2, 3, cols) gives (2, 3, rows), the flattened product; bfloat16 and
    float16 x are cast to float32 (the same result as casting first), so are float16
    scales and biases; transposed and sliced views give their contiguous copies' result."""
    cols = 256
    parts, _ = quantized(48, cols, 64, 4)
    codes, scales, biases, group = operands(parts)

    def op(x, s=scales, b=biases):
        return np.array(EXT.codes_matmul(x, codes, s, b, bits=4, group=group))

    x = mx.array(activations(6, cols))
    batched = op(x.reshape(2, 3, cols))
    assert batched.shape == (2, 3, 48)
    assert np.array_equal(batched.reshape(6, 48), op(x))

    for dtype in (mx.bfloat16, mx.float16):
        low = x.astype(dtype)
        got = EXT.codes_matmul(low, codes, scales, biases, bits=4, group=group)
        assert got.dtype == mx.float32
        assert np.array_equal(np.array(got), op(low.astype(mx.float32)))
    s16, b16 = scales.astype(mx.float16), biases.astype(mx.float16)
    assert np.array_equal(op(x, s16, b16), op(x, s16.astype(mx.float32), b16.astype(mx.float32)))

    base = mx.array(activations(cols, 5, seed=2))  # (cols, 5): its transpose is a view
    transposed = base.T
    assert np.array_equal(op(transposed), op(mx.array(np.array(transposed))))
    wide = mx.array(activations(7, cols + 64, seed=5))
    for view in (wide[:, 32:32 + cols], wide[::2, :cols]):
        assert np.array_equal(op(view), op(mx.array(np.array(view))))


def test_weight_views_and_traced_weights_add_no_node_and_give_the_same_product():
    """The weight's arrays as views (every other row) give their contiguous copies'
    product, also through a compiled function that takes them as inputs (as the decode
    halves do); and the product is one node, with no copy of an input before it."""
    cols = 128
    parts, _ = quantized(32, cols, 32, 4)
    codes, scales, biases, group = operands(parts)
    x = mx.array(activations(3, cols))

    def op(c, s, b):
        return EXT.codes_matmul(x, c, s, b, bits=4, group=group)

    views = codes[::2], scales[::2], biases[::2]
    copies = [mx.array(np.array(v)) for v in views]
    assert np.array_equal(np.array(op(*views)), np.array(op(*copies)))

    compiled = mx.compile(op)  # the weight's arrays are placeholders while it traces
    assert np.array_equal(np.array(compiled(codes, scales, biases)),
                          np.array(op(codes, scales, biases)))
    dot = io.StringIO()
    mx.export_to_dot(dot, op(codes, scales, biases))
    assert "Contiguous" not in dot.getvalue() and "CodesMatmul" in dot.getvalue()


def test_empty_batch():
    """x with no rows gives an empty (0, rows) result rather than an error."""
    parts, _ = quantized(16, 64, 32, 4)
    got = matmul(np.zeros((0, 64), np.float32), parts)
    assert got.shape == (0, 16)


def test_concurrent_streams_give_the_serial_results():
    """Products evaluated at once on two CPU streams from two Python threads (one holds
    the kernel's thread pool, the other runs alone) give the same bits as one at a time."""
    cols = 512
    parts, _ = quantized(256, cols, 32, 4)
    codes, scales, biases, group = operands(parts)
    xs = [mx.array(activations(m, cols, seed=m)) for m in (1, 2, 5, 8)]
    serial = [np.array(EXT.codes_matmul(x, codes, scales, biases, bits=4, group=group))
              for x in xs]
    results, errors = {}, []

    def worker(k):
        try:
            stream = mx.new_stream(mx.cpu)
            for i in range(40):
                j = (i + k) % len(xs)
                y = EXT.codes_matmul(xs[j], codes, scales, biases, bits=4, group=group,
                                     stream=stream)
                mx.eval(y)
                if not np.array_equal(np.array(y), serial[j]):
                    results[k] = (i, j)
                    return
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not results, (errors, results)


_OVERSUBSCRIBED = """
import numpy as np, mlx.core as mx
from veloxquant_mlx.kernels.build import load
ext = load()
rng = np.random.default_rng(0)
codes = mx.array(rng.integers(0, 256, (1000, 256), dtype=np.uint8))
scales = mx.array(rng.random((1000, 16), dtype=np.float32))
biases = mx.array(rng.random((1000, 16), dtype=np.float32))
for m in (1, 7):
    x = mx.array(rng.standard_normal((m, 512), dtype=np.float32))
    first = np.array(ext.codes_matmul(x, codes, scales, biases, bits=4, group=32))
    alone = np.array(ext.codes_matmul(x, codes, scales, biases, bits=4, group=32,
                                      portable=True))
    assert np.allclose(first, alone, rtol=1e-5, atol=1e-4)
    for _ in range(300):
        y = ext.codes_matmul(x, codes, scales, biases, bits=4, group=32)
        mx.eval(y)
        assert np.array_equal(np.array(y), first)
print("ok")
"""


def test_more_threads_than_cores_share_each_product_in_chunks():
    """Six threads on this machine's cores: helpers that start late leave their chunks to
    the others, and every product still comes out in the same bits, with no hang."""
    env = {**os.environ, "VELOXQUANT_QMM_THREADS": "6"}
    out = subprocess.run([sys.executable, "-c", _OVERSUBSCRIBED], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_compiled_graph_matches_eager():
    """Inside mx.compile (as compiled decode runs a model) the operation gives the eager
    result."""
    parts, _ = quantized(64, 256, 32, 8)
    codes, scales, biases, group = operands(parts)

    def f(x):
        return EXT.codes_matmul(x, codes, scales, biases, bits=8, group=group) * 2.0

    x = mx.array(activations(3, 256))
    assert np.array_equal(np.array(mx.compile(f)(x)), np.array(f(x)))


# ------------------------------------------------------------------ validation


def _bad_inputs():
    x = mx.zeros((2, 256))
    codes4 = mx.zeros((8, 128), mx.uint8)  # 8 rows of 256 4-bit codes
    sb = mx.ones((8, 8))
    return [
        ("1-D codes", dict(x=x, codes=mx.zeros((1024,), mx.uint8), scales=sb, biases=sb,
                           bits=4, group=32), "codes must be a 2-D uint8 array"),
        ("int8 codes", dict(x=x, codes=mx.zeros((8, 128), mx.int8), scales=sb, biases=sb,
                            bits=4, group=32), "codes must be a 2-D uint8 array"),
        ("uint32 codes", dict(x=x, codes=mx.zeros((8, 32), mx.uint32), scales=sb, biases=sb,
                              bits=4, group=32), "codes must be a 2-D uint8 array"),
        ("0-D x", dict(x=mx.array(1.0), codes=codes4, scales=sb, biases=sb, bits=4, group=32),
         "x must have 1 to 8 dimensions, got 0"),
        ("9-D x", dict(x=mx.zeros((1,) * 8 + (32,)), codes=codes4, scales=sb, biases=sb,
                       bits=4, group=32), "x must have 1 to 8 dimensions, got 9"),
        ("cols not a multiple of 32", dict(x=mx.zeros((2, 48)), codes=mx.zeros((8, 24), mx.uint8),
                                           scales=mx.ones((8, 1)), biases=mx.ones((8, 1)),
                                           bits=4, group=32), "not a multiple of 32"),
        ("fewer than 32 cols", dict(x=mx.zeros((2, 16)), codes=mx.zeros((8, 8), mx.uint8),
                                    scales=mx.ones((8, 1)), biases=mx.ones((8, 1)),
                                    bits=4, group=32), "at least 1 row and 32 columns"),
        ("no weight rows", dict(x=x, codes=mx.zeros((0, 128), mx.uint8), scales=mx.ones((0, 8)),
                                biases=mx.ones((0, 8)), bits=4, group=32),
         "at least 1 row and 32 columns"),
        ("5 bits", dict(x=x, codes=codes4, scales=sb, biases=sb, bits=5, group=32),
         "neither 4 nor 8 bits"),
        ("group 64", dict(x=x, codes=codes4, scales=mx.ones((8, 4)), biases=mx.ones((8, 4)),
                          bits=4, group=64), "a scale must cover 32 columns"),
        ("group 16 at 4 bits", dict(x=x, codes=codes4, scales=mx.ones((8, 16)),
                                    biases=mx.ones((8, 16)), bits=4, group=16),
         "a scale must cover 32 columns"),
        ("codes narrower than x", dict(x=mx.zeros((2, 512)), codes=codes4, scales=mx.ones((8, 16)),
                                       biases=mx.ones((8, 16)), bits=4, group=32),
         "codes hold 256 columns a row, x has 512"),
        ("8-bit width as 4-bit", dict(x=x, codes=mx.zeros((8, 256), mx.uint8), scales=sb,
                                      biases=sb, bits=4, group=32),
         "codes hold 512 columns a row, x has 256"),
        ("too few scales", dict(x=x, codes=codes4, scales=mx.ones((8, 4)), biases=sb,
                                bits=4, group=32), "scales and biases need 64 values each, got 32"),
        ("too many biases", dict(x=x, codes=codes4, scales=sb, biases=mx.ones((8, 16)),
                                 bits=4, group=32),
         "scales and biases need 64 values each, got 64 and 128"),
        ("16-column scales for a group of 32", dict(x=x, codes=mx.zeros((8, 256), mx.uint8),
                                                    scales=mx.ones((8, 16)),
                                                    biases=mx.ones((8, 16)), bits=8, group=32),
         "scales and biases need 64 values"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_inputs())),
                         ids=[case[0] for case in _bad_inputs()])
def test_bad_inputs_raise_value_error(index):
    """Each malformed input is refused when the operation is built (before any evaluation
    could read past a buffer), as a ValueError saying what is wrong."""
    _, kwargs, message = _bad_inputs()[index]
    kwargs = dict(kwargs)
    x, codes, scales, biases = (kwargs.pop(k) for k in ("x", "codes", "scales", "biases"))
    with pytest.raises(ValueError, match=f"^codes_matmul: .*{message}"):
        EXT.codes_matmul(x, codes, scales, biases, **kwargs)


def test_eight_bit_codes_with_16_column_groups_are_accepted():
    """The one group-16 case the kernel serves (8 bits) passes validation."""
    y = EXT.codes_matmul(mx.zeros((1, 64)), mx.zeros((2, 64), mx.uint8), mx.ones((2, 4)),
                         mx.zeros((2, 4)), bits=8, group=16)
    assert np.array(y).shape == (1, 2)


# ------------------------------------------------------------------ layers


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_codes_linear_matches_quantized_linear(bits, bias):
    """CodesLinear made from a QuantizedLinear (its bias carried over) gives the
    QuantizedLinear's output within the int8 rounding, and exactly the emulation."""
    mx.random.seed(11)
    layer = nn.QuantizedLinear.from_linear(nn.Linear(256, 96, bias=bias), group_size=64,
                                           bits=bits)
    if bias:  # nn.Linear's bias is small: make it matter
        layer.bias = mx.random.normal((96,))
    codes = CodesLinear(layer_parts(layer), layer.get("bias"))
    assert ("bias" in codes) == bias
    x = mx.random.normal((2, 5, 256))
    got, want = np.array(codes(x)), np.array(layer(x))
    assert got.shape == want.shape == (2, 5, 96)
    assert rel_err(got, want) < 0.02
    exact = emulate(np.array(x).reshape(10, 256),
                    kernel_weight(layer_parts(layer))).reshape(2, 5, 96)
    if bias:
        exact = exact + np.array(layer.bias)
    assert rel_err(got, exact) < 1e-5


EMBEDDING_BITS = [4, 8]


def quantized_table(bits: int, group: int):
    mx.random.seed(bits + group)
    return nn.QuantizedEmbedding.from_embedding(nn.Embedding(200, 128), group_size=group,
                                                bits=bits)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("bits", EMBEDDING_BITS)
def test_codes_embedding_lookup_matches_quantized_embedding(bits, group):
    """CodesEmbedding's lookup of (2, 5) ids decodes the rows the kernel holds (pure
    dequantization: equal to float rounding), and QuantizedEmbedding's within the float16
    rounding of the scales and biases."""
    table = quantized_table(bits, group)
    parts = layer_parts(table)
    codes = CodesEmbedding(parts)
    held = kernel_weight(parts)
    ids = np.random.default_rng(2).integers(0, 200, (2, 5))
    got, want = np.array(codes(mx.array(ids))), np.array(table(mx.array(ids)))
    assert got.shape == want.shape == (2, 5, 128)
    np.testing.assert_allclose(got, held[ids], rtol=0, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=0, atol=np.abs(want).max() * 2e-3)
    one = np.array(codes(mx.array([7])))  # 1-D ids too
    np.testing.assert_allclose(one, held[[7]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("bits", [4, 8])
def test_codes_embedding_as_linear_matches_quantized_embedding(bits, group):
    """CodesEmbedding.as_linear (a tied LM head) matches QuantizedEmbedding.as_linear
    within the int8 rounding."""
    table = quantized_table(bits, group)
    codes = CodesEmbedding(layer_parts(table))
    x = mx.random.normal((2, 3, 128))
    got, want = np.array(codes.as_linear(x)), np.array(table.as_linear(x))
    assert got.shape == want.shape == (2, 3, 200)
    assert rel_err(got, want) < 0.02


@pytest.mark.parametrize("bits", EMBEDDING_BITS)
def test_use_codes_on_a_small_llama(bits):
    """use_codes swaps every quantized layer of a real mlx-lm model (attention, MLP and
    the tied embedding / LM head), leaves none behind, and the logits stay those of the
    quantized model up to the activations' int8 rounding."""
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=256, num_attention_heads=4,
                           num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                           tie_word_embeddings=True)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=bits)

    def quantized_layers():
        return [p for p, m in model.named_modules()
                if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]

    expected = len(quantized_layers())
    assert expected == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the embedding
    tokens = mx.array(np.random.default_rng(0).integers(0, 512, (2, 24)))
    before = np.array(model(tokens))
    assert use_codes(model) == expected
    assert quantized_layers() == []
    kinds = {type(m) for _, m in model.named_modules()}
    assert CodesLinear in kinds and CodesEmbedding in kinds
    after = np.array(model(tokens))
    assert after.shape == before.shape == (2, 24, 512)
    assert np.isfinite(after).all()
    assert rel_err(after, before) < 0.05
    agree = (after.argmax(-1) == before.argmax(-1)).mean()
    assert agree >= 0.9, agree
    assert use_codes(model) == 0  # nothing quantized is left to replace


# ------------------------------------------------------------------ build


def test_load_is_cached_and_built_against_installed_mlx():
    """load() imports the extension once per process, from the cache folder named by
    build_tag(); the headers it was compiled with are the installed MLX's (a Primitive
    built against another MLX would not be ABI-compatible)."""
    assert load() is EXT and load() is load()
    assert EXT.mlx_version == mx.__version__
    assert EXT.kernel_path() in ("avx2", "portable")
    folder = build()
    assert folder == cache_root() / build_tag()
    assert any(folder.glob("_codes_matmul*.so"))
    assert mx.__version__ in build_tag()


@pytest.mark.parametrize("portable", PATHS)
def test_products_over_float32_above_rows_are_float32_exact(portable):
    """Past ``float32_above`` rows the product is float32 x times the dequantized weights
    (the kernel's own with AVX2; the BLAS's where a CPU lacks it, which ``portable``
    forces): no int8 rounding, so it matches the float product to float rounding; at or
    under the bound it keeps int8 activations."""
    from veloxquant_mlx.blas_status import active_blas

    if not load().float32_available(portable=portable):
        pytest.skip(f"no float32 path here (AVX2, or a BLAS: {active_blas()})")
    w = mx.random.normal((300, 256), key=mx.random.key(7))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    parts = QuantizedParts(np.array(wq), np.array(s), np.array(b), 64, 4)
    codes = mx.array(kernel_codes(parts.packed, 4))
    ks, kb = (mx.array(a) for a in kernel_groups(parts))
    ref_w = kernel_weight(parts)
    for m, exact in ((17, True), (16, False)):
        x = mx.random.normal((m, 256), key=mx.random.key(m))
        got = load().codes_matmul(x, codes, ks, kb, bits=4, group=32, float32_above=16,
                                  portable=portable)
        err = rel_err(np.array(got), np.array(x) @ ref_w.T)
        assert (err < 1e-5) if exact else (1e-4 < err < 2e-2), (m, err)


FLOAT32_SHAPES = [
    # (x rows, weight rows, columns): rows of x past one 16-row tile, an 8-row last tile,
    # more than one 128-row block; weight rows that are no multiple of the 6-row tile or
    # the 48-row block; columns with a short last 256-column block, and many blocks.
    pytest.param(17, 50, 32, id="smallest"),
    pytest.param(24, 97, 288, id="short-last-block"),
    pytest.param(136, 61, 512, id="two-row-blocks"),
    pytest.param(40, 300, 2080, id="many-blocks"),
]


@pytest.mark.skipif(not AVX2, reason="the AVX2 float32 path")
@pytest.mark.parametrize("m, rows, cols", FLOAT32_SHAPES)
@pytest.mark.parametrize("kind", ["q4-half", "q4-float", "q8-16"])
def test_float32_path_tiles_every_shape(m, rows, cols, kind):
    """The AVX2 float32 path (codes_gemm.c) tiles x and the weights in blocks: every shape,
    whole or cut short at any of its block edges, gives x times the dequantized weights to
    float32 rounding, with float16 or float32 scales and 16-column groups; and a row's
    results are the same bits whichever rows share its product."""
    if kind == "q8-16":
        parts, weight = group16(rows, cols, seed=m)
    else:
        parts, weight = quantized(rows, cols, 32, 4, seed=m)
    codes, scales, biases, group = operands(parts)
    if kind == "q4-half":  # float16 scales: the layout of GGUF's Q4_0 and Q4_1
        scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
        weight = kernel_weight(QuantizedParts(
            parts.packed, np.array(scales.astype(mx.float32)),
            np.array(biases.astype(mx.float32)), parts.group_size, parts.bits))
    x = activations(m, cols, seed=rows)

    def product(rows_of_x):
        return np.array(EXT.codes_matmul(mx.array(rows_of_x), codes, scales, biases,
                                         bits=parts.bits, group=group, float32_above=16))

    got = product(x)
    assert got.shape == (m, rows)
    assert rel_err(got, x.astype(np.float64) @ weight.T) < 1e-5  # int8 x: ~1e-3
    # the same rows in a product of 17 rows, and placed last in a larger one
    assert np.array_equal(product(x[:17]), got[:17])
    wider = product(np.concatenate([activations(30, cols, seed=5), x[-17:]]))
    assert np.array_equal(wider[30:], got[-17:])


@pytest.mark.parametrize("portable", [False, True])
def test_precise_recomputes_each_rows_largest_results_exactly(portable):
    """``precise`` (an LM head): after the int8 product each row's ``exact_top`` largest
    results are recomputed in float32 (the product of x and the dequantized weights to
    float32 rounding); the rest keep int8's error, and a row still does not depend on its
    neighbours."""
    top = load().exact_top
    parts, weight = quantized(600, 512, 32, 4, seed=3)
    codes, scales, biases, group = operands(parts)
    x = mx.array(activations(6, 512, seed=4))
    exact = np.array(x) @ weight.T

    def product(rows, precise):
        return np.array(load().codes_matmul(rows, codes, scales, biases, bits=4, group=group,
                                            portable=portable, precise=precise))

    plain, precise = product(x, False), product(x, True)
    assert rel_err(plain, exact) > 1e-3
    for r in range(6):
        chosen = np.argsort(-plain[r], kind="stable")[:top]
        rest = np.setdiff1d(np.arange(600), chosen)
        assert np.allclose(precise[r, chosen], exact[r, chosen], rtol=1e-5, atol=1e-4), r
        assert np.array_equal(precise[r, rest], plain[r, rest]), r
        # the largest exact result is among those recomputed, so greedy picks are exact
        assert np.argmax(precise[r]) == np.argmax(exact[r]), r
    assert np.array_equal(precise[2], product(x[2:3], True)[0])


def test_precise_with_fewer_rows_than_exact_top_is_exact_everywhere():
    """A weight with at most ``exact_top`` rows is recomputed whole: float32's product."""
    parts, weight = quantized(40, 256, 32, 8, seed=5)
    codes, scales, biases, group = operands(parts)
    x = mx.array(activations(3, 256, seed=6))
    got = np.array(load().codes_matmul(x, codes, scales, biases, bits=8, group=group,
                                       precise=True))
    assert rel_err(got, np.array(x) @ weight.T) < 1e-5


def test_float16_scales_are_read_as_float16_and_codes_linear_keeps_them_when_exact():
    """Scales and biases given as float16 are used as float16 (half the bytes: GGUF's Q4_1
    holds them so); CodesLinear stores float16 only where that is exact, and float32 for
    scales float16 cannot hold (K-quants' products of two scales)."""
    parts, _ = quantized(64, 256, 32, 4)
    halves = QuantizedParts(parts.packed, parts.scales.astype(np.float16).astype(np.float32),
                            parts.biases.astype(np.float16).astype(np.float32), 32, 4)
    codes, scales, biases, group = operands(halves)
    x = activations(3, 256, seed=5)
    got = EXT.codes_matmul(mx.array(x), codes, scales.astype(mx.float16),
                           biases.astype(mx.float16), bits=4, group=group)
    assert rel_err(np.array(got), emulate(x, kernel_weight(halves))) < 1e-5
    assert CodesLinear(halves).scales.dtype == mx.float16
    assert CodesLinear(parts).scales.dtype == mx.float32  # float32 scales of mx.quantize
    assert np.array_equal(np.array(CodesLinear(halves)(mx.array(x))), np.array(got))
