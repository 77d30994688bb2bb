"""The block decoders against the ``gguf`` package's own dequantization, and against mx.load.

Random bytes cover every code, scale and mask bit of a block; only the float16
``d``/``dmin`` fields are set to finite values (random bytes there would be
NaN or infinity now and then, which compares unequal to itself).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import dequantize

from tests.gguf import synth
from veloxquant_mlx.gguf import read_header
from veloxquant_mlx.gguf.blocks import DECODED_TYPES, decode_tensor, pack_codes
from veloxquant_mlx.gguf.ggml_types import GGML_TYPES, QUANT_BITS

# Byte offsets of each type's float16 fields (d, and m or dmin where it has one).
FLOAT16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
                  "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,),
                  "Q2_K": (80, 82)}  # fmt: skip
ROWS, COLS = 5, 768


def random_blocks(kind: str, rng: np.random.Generator) -> np.ndarray:
    """``ROWS`` rows of random ``kind`` blocks with finite, varied float16 fields."""
    gtype = next(t for t in GGML_TYPES.values() if t.name == kind)
    blocks = rng.integers(0, 256, (ROWS * COLS // gtype.block_size, gtype.type_size),
                          dtype=np.uint8)
    for at in FLOAT16_FIELDS[kind]:
        values = rng.uniform(-0.02, 0.02, blocks.shape[0]).astype(np.float16)
        blocks[:, at:at + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(ROWS, -1)


@pytest.fixture(scope="module")
def block_file(tmp_path_factory):
    """One file with a random tensor of every decoded type; ``(header, raw blocks)``."""
    rng = np.random.default_rng(7)
    raw = {kind: random_blocks(kind, rng) for kind in DECODED_TYPES}
    path = tmp_path_factory.mktemp("blocks") / "blocks.gguf"
    synth.write_minimal(path, tensors={f"{k}.weight": (b, k) for k, b in raw.items()})
    return read_header(path), raw


def decoded_values(out: dict[str, np.ndarray], kind: str) -> np.ndarray:
    """The float32 values a decoded tensor stands for (affine triples dequantized in float32)."""
    if kind not in QUANT_BITS:
        return out["weight"]
    values = mx.dequantize(mx.array(out["weight"]), mx.array(out["scales"], mx.float32),
                           mx.array(out["biases"], mx.float32), group_size=32,
                           bits=QUANT_BITS[kind])
    return np.array(values)


@pytest.mark.parametrize("kind", DECODED_TYPES)
def test_decoded_values_equal_ggml_dequantization(block_file, kind):
    header, raw = block_file
    info = next(t for t in header.tensors if t.name == f"{kind}.weight")
    out = decode_tensor(header.path, info)
    want = dequantize(raw[kind], synth.Q[kind])
    got = decoded_values(out, kind)
    assert got.shape == want.shape == (ROWS, COLS)
    # Exact where the affine parts are exact (all but float16 products of rounding).
    np.testing.assert_allclose(got, want, rtol=0, atol=np.abs(want).max() * 1e-6)
    if kind in QUANT_BITS:
        assert out["weight"].dtype == np.uint32
        assert out["weight"].shape == (ROWS, COLS * QUANT_BITS[kind] // 32)
        assert out["scales"].shape == out["biases"].shape == (ROWS, COLS // 32)
        # K sub-block scales are products d * sc: float32 keeps them exact.
        assert out["scales"].dtype == (np.float32 if kind.endswith("_K") else np.float16)
    else:
        assert set(out) == {"weight", "codes16", "scales16", "biases16"}
        assert out["weight"].dtype == np.float32


@pytest.mark.parametrize("kind", ["Q6_K", "Q3_K", "Q2_K"])
def test_sixteen_value_types_keep_their_codes_as_a_group16_triple(block_file, kind):
    """``scale * u + bias`` per 16 columns (8-bit ``u``) is ggml's value, to float rounding;
    the codes stay in the type's own range (Q6_K six bits around 128, Q3_K three, Q2_K two)."""
    header, raw = block_file
    info = next(t for t in header.tensors if t.name == f"{kind}.weight")
    out = decode_tensor(header.path, info)
    codes = out["codes16"].view(np.uint8).reshape(ROWS, COLS).astype(np.float64)
    assert out["scales16"].shape == out["biases16"].shape == (ROWS, COLS // 16)
    assert out["scales16"].dtype == out["biases16"].dtype == np.float32
    values = (np.repeat(out["scales16"], 16, axis=1) * codes
              + np.repeat(out["biases16"], 16, axis=1))
    want = dequantize(raw[kind], synth.Q[kind]).astype(np.float64)
    np.testing.assert_allclose(values, want, rtol=0, atol=np.abs(want).max() * 1e-6)
    low, high = {"Q6_K": (96, 159), "Q3_K": (124, 131), "Q2_K": (128, 131)}[kind]
    assert low <= codes.min() and codes.max() <= high


def test_legacy_types_are_bit_identical_to_mx_load(block_file, tmp_path):
    """Q4_0/Q4_1/Q8_0 as MLX's own GGUF reader repacked them (the converter used it before)."""
    _, raw = block_file
    kinds = ("Q8_0", "Q4_0", "Q4_1")
    path = synth.write_minimal(tmp_path / "legacy.gguf",
                               tensors={f"{k}.weight": (raw[k], k) for k in kinds})
    header, by_mlx = read_header(path), mx.load(str(path))
    for info in header.tensors:
        base = info.name.removesuffix(".weight")
        for key, ours in decode_tensor(path, info).items():
            theirs = np.array(by_mlx[f"{base}.{key}"])
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (base, key)
            np.testing.assert_array_equal(ours, theirs, err_msg=f"{base}.{key}")


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packed_codes_read_back_through_mlx(bits):
    codes = np.random.default_rng(bits).integers(0, 2**bits, (3, 96)).astype(np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == np.uint32 and packed.shape == (3, 96 * bits // 32)
    ones, zeros = mx.ones((3, 3)), mx.zeros((3, 3))
    back = mx.dequantize(mx.array(packed), ones, zeros, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(back), codes)


def test_large_tensors_decode_in_slabs(tmp_path, monkeypatch):
    """Row slabs join up in order: a tiny slab size gives the same result as one slab."""
    from veloxquant_mlx.gguf import blocks

    rng = np.random.default_rng(3)
    raw = random_blocks("Q5_K", rng)
    path = synth.write_minimal(tmp_path / "slabs.gguf", tensors={"a.weight": (raw, "Q5_K")})
    info = read_header(path).tensors[0]
    whole = decode_tensor(path, info)
    monkeypatch.setattr(blocks, "_SLAB_BYTES", 1)  # one row a slab
    sliced = decode_tensor(path, info)
    for key in whole:
        np.testing.assert_array_equal(whole[key], sliced[key])
