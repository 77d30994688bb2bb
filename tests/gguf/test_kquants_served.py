"""A Q4_K_M-style file as the server loads it: sizes, the float32 plan, and the codes.

The converted folder mixes 4-bit (Q4_K, float32 scales), 5-bit (Q5_0) and
float (Q6_K, with group-16 codes beside it) matrices; the server's CPU default
must compute all three from their codes (veloxquant_mlx/codes_linear.py), and
``model.max_dequantized_bytes`` above the float32 size must serve the file exactly.
"""

from __future__ import annotations

import math

import mlx_lm
import numpy as np
import pytest
from gguf import GGUFReader

from server.model_loader import load_model
from server.model_weights import float32_bytes
from server.settings import ModelSection
from tests.gguf.reference import ReferenceModel
from tests.gguf.test_logits import SYNTH_PROMPT, TOLERANCE, mlx_logits
from veloxquant_mlx.codes_linear import layer_parts
from veloxquant_mlx.quant_weights import load_group16_parts

# More than enough for any test model's float32 copy: the exact float32 opt-in.
EXACT_FLOAT32 = 10**12


def test_float32_size_counts_every_logical_weight(synthetic_files, synthetic_converted):
    """5-bit rows are bit streams: words * 32 / bits values, not words * (32 // bits)."""
    model, _ = mlx_lm.load(str(synthetic_converted["Q4_K_M"]))
    elements = sum(math.prod(int(d) for d in t.shape)
                   for t in GGUFReader(str(synthetic_files["Q4_K_M"])).tensors)
    assert float32_bytes(model) == 4 * elements


def test_every_affine_layer_keeps_codes_for_the_cpu_kernel(synthetic_converted):
    """4-bit Q4_K as stored; 5-bit Q5_0 widened to a byte a code; Q6_K (float) has none."""
    import mlx.core as mx

    model, _ = mlx_lm.load(str(synthetic_converted["Q4_K_M"]))
    parts = {path: found for path, module in model.named_modules()
             if (found := layer_parts(module)) is not None}
    assert "model.layers.0.mlp.down_proj" not in parts  # Q6_K: a float matrix
    assert "lm_head" not in parts  # Q6_K
    assert {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj",
            "model.layers.1.mlp.gate_proj"} <= set(parts)
    q_proj = parts["model.layers.0.self_attn.q_proj"]
    assert q_proj.bits == 4 and q_proj.scales.dtype == np.float32
    down = parts["model.layers.1.mlp.down_proj"]  # Q5_0
    assert down.bits == 8
    layer = model.model.layers[1].mlp.down_proj
    want = mx.dequantize(layer.weight, layer.scales.astype(mx.float32),
                         layer.biases.astype(mx.float32), group_size=32, bits=5)
    got = mx.dequantize(mx.array(down.packed), mx.array(down.scales), mx.array(down.biases),
                        group_size=32, bits=8)
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_the_server_plan_serves_the_file_exactly(synthetic_files, tmp_path, monkeypatch):
    """With a budget that holds the float32 copy: dequantized, every product exact, as the
    reference computes."""
    monkeypatch.setenv("VELOXQUANT_HOME", str(tmp_path))
    section = ModelSection(path=str(synthetic_files["Q4_K_M"]),
                           max_dequantized_bytes=EXACT_FLOAT32)
    loaded = load_model(section)
    assert loaded.weights.startswith("quantized weights dequantized to float32")
    assert loaded.dtype == "float32" and not loaded.quantized and loaded.codes_layers == 0
    got = mlx_logits(loaded.model, SYNTH_PROMPT)
    want = ReferenceModel(synthetic_files["Q4_K_M"]).logits(SYNTH_PROMPT)
    assert np.abs(got - want).max() <= TOLERANCE


@pytest.mark.parametrize("variant", ["Q4_K_M", "Q3_K"])
def test_sixteen_value_matrices_keep_codes_matching_their_float32_weights(
        synthetic_converted, variant):
    """``codes16.safetensors`` holds a group-16 triple for every Q6_K/Q3_K matrix, renamed
    and (q/k) unpermuted as its float32 weight was: dequantized, it is that weight."""
    import mlx.core as mx

    folder = synthetic_converted[variant]
    parts = load_group16_parts(folder)
    weights = mx.load(str(folder / "model.safetensors"))
    expected = {"Q4_K_M": {"lm_head", "model.layers.0.self_attn.v_proj",
                           "model.layers.0.mlp.down_proj"},
                "Q3_K": {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
                         "model.layers.1.mlp.down_proj"}}[variant]
    assert expected <= set(parts)
    for module, part in parts.items():
        assert part.group_size == 16 and part.bits == 8
        weight = np.array(weights[f"{module}.weight"]).astype(np.float64)
        codes = part.packed.view(np.uint8).reshape(weight.shape).astype(np.float64)
        values = (np.repeat(part.scales, 16, axis=1) * codes
                  + np.repeat(part.biases, 16, axis=1))
        np.testing.assert_allclose(values, weight, rtol=0,
                                   atol=np.abs(weight).max() * 1e-6, err_msg=module)


def _codes_op_or_skip() -> None:
    from veloxquant_mlx.kernels.build import KernelBuildError, load

    try:
        load()
    except KernelBuildError as exc:
        pytest.skip(f"the codes_matmul extension cannot be built here: {exc}")


def _decode_logits(model, tokens: list[int]) -> np.ndarray:
    """Logits of ``tokens`` fed one a call, as decode runs them (products of one row)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    rows = [np.array(model(mx.array([[token]]), cache=cache)[0, -1]) for token in tokens]
    return np.stack(rows).astype(np.float64)


def test_the_server_computes_every_matrix_from_its_codes(synthetic_files, tmp_path,
                                                          monkeypatch):
    """The CPU default: every matrix of the Q4_K_M file, its Q6_K head, value and down
    projections (group-16 codes) and its Q5_0 ones (widened) included, computes from its
    codes; decode logits stay at the int8 activations' distance from the float64
    reference and from the exact float32 load."""
    import mlx.nn as nn

    from veloxquant_mlx.codes_linear import CodesEmbedding, CodesLinear

    _codes_op_or_skip()
    monkeypatch.setenv("VELOXQUANT_HOME", str(tmp_path))
    path = str(synthetic_files["Q4_K_M"])
    loaded = load_model(ModelSection(path=path))
    model = loaded.model
    layers = len(model.layers)
    matrices = 7 * layers + 2  # q, k, v, o, gate, up, down a layer; the head; the embedding
    assert loaded.codes_layers == matrices, loaded.weights
    assert loaded.weights.startswith("quantized weights computed from their codes")
    assert loaded.weights.endswith(f"({matrices} layers from codes)"), loaded.weights
    assert loaded.quantized
    kinds = {p: type(m) for p, m in model.named_modules()}
    assert not [p for p, k in kinds.items()
                if k in (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)]
    assert kinds["model.embed_tokens"] is CodesEmbedding
    head = model.lm_head
    assert type(head) is CodesLinear and (head.bits, head.group) == (8, 16)  # Q6_K
    assert model.model.layers[1].mlp.down_proj.bits == 8  # Q5_0, widened to a byte a code
    assert model.model.layers[0].self_attn.q_proj.bits == 4  # Q4_K
    # No float32 copy is held: 4-bit codes and group-16 bytes with float32 scales.
    assert loaded.weight_bytes < float32_bytes(mlx_lm.load(
        str(next((tmp_path / "models").rglob("config.json")).parent))[0]) / 2

    want = ReferenceModel(synthetic_files["Q4_K_M"]).logits(SYNTH_PROMPT)
    got = _decode_logits(model, SYNTH_PROMPT)
    exact = _decode_logits(load_model(ModelSection(
        path=path, max_dequantized_bytes=EXACT_FLOAT32)).model, SYNTH_PROMPT)
    scale = np.abs(want).max()
    assert np.abs(exact - want).max() <= TOLERANCE  # the float32 load: the reference's
    # int8 activations on this random 256-wide model: ~0.04 of 3.5 (0.25 while the bias
    # term took x's exact sums; the kernel's own math: tests/test_codes_matmul.py).
    assert 0 < np.abs(got - exact).max() < 0.03 * scale
    assert np.abs(got - want).max() < 0.03 * scale
    # Greedy picks are the reference's, but where its top two logits lie closer than that
    # noise: one of these 8 positions is such a near tie (0.006 apart), which goes either way.
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.03 * scale
    assert clear.sum() >= len(SYNTH_PROMPT) - 1
    assert (got.argmax(1) == want.argmax(1))[clear].all()


def test_a_long_prompt_from_the_codes_gives_the_float32_logits(synthetic_files, tmp_path,
                                                              monkeypatch):
    """Products of more than INT8_MAX_ROWS rows multiply float32 activations by the weights
    the codes stand for: a prompt's logits are then the reference's, Q6_K, Q5_0 and Q4_K
    matrices alike; one of INT8_MAX_ROWS rows still rounds its activations to int8."""
    import mlx.core as mx

    from veloxquant_mlx.codes_linear import INT8_MAX_ROWS

    _codes_op_or_skip()
    monkeypatch.setenv("VELOXQUANT_HOME", str(tmp_path))
    loaded = load_model(ModelSection(path=str(synthetic_files["Q4_K_M"])))
    reference = ReferenceModel(synthetic_files["Q4_K_M"])
    tokens = (SYNTH_PROMPT * 8)[:INT8_MAX_ROWS + 8]
    got = np.array(loaded.model(mx.array([tokens]))[0]).astype(np.float64)
    assert np.abs(got - reference.logits(tokens)).max() <= TOLERANCE
    short = tokens[:INT8_MAX_ROWS]
    got = np.array(loaded.model(mx.array([short]))[0]).astype(np.float64)
    assert np.abs(got - reference.logits(short)).max() > 10 * TOLERANCE
