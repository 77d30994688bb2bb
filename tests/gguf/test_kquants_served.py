"""A Q4_K_M-style file as the server loads it: sizes, the float32 plan, and the codes kept.

The converted folder mixes 4-bit (Q4_K, float32 scales), 5-bit (Q5_0) and
float (Q6_K) matrices; the server's CPU plan must size, dequantize and serve
all three, and keep codes for the decode kernel of every quantized one.
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
from tests import test_quant_matmul
from tests.gguf.reference import ReferenceModel
from tests.gguf.test_logits import SYNTH_PROMPT, TOLERANCE, mlx_logits
from veloxquant_mlx.quant_weights import capture_quantized_layers, load_group16_parts


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
    parts = capture_quantized_layers(model)
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
    """Dequantized to float32 (codes off: every product exact), as the reference computes."""
    monkeypatch.setenv("VELOXQUANT_HOME", str(tmp_path))
    section = ModelSection(path=str(synthetic_files["Q4_K_M"]), quantized_matmul_rows=0)
    loaded = load_model(section)
    assert loaded.weights.startswith("quantized weights dequantized to float32")
    assert loaded.dtype == "float32" and not loaded.quantized
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


SERVED_CHECK = """
import json, sys
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from server.model_loader import load_model
from server.settings import ModelSection
from tests.gguf.reference import ReferenceModel
from tests.gguf.test_logits import SYNTH_PROMPT

loaded = load_model(ModelSection(path=sys.argv[1]))
copies = loaded.quantized_copies
before = copies.served()
cache = make_prompt_cache(loaded.model)
logits = []
for token in SYNTH_PROMPT:  # one row a call, as decode: every product from the codes
    logits.append(np.array(loaded.model(mx.array([[token]]), cache=cache)[0, -1]))
want = ReferenceModel(sys.argv[1]).logits(SYNTH_PROMPT)
got = np.stack(logits).astype(np.float64)
print(json.dumps({"registered": len(copies), "served": copies.served() - before,
                  "weights": loaded.weights, "layers": len(loaded.model.layers),
                  "max_diff": float(np.abs(got - want).max()),
                  "scale": float(np.abs(want).max()),
                  "same_argmax": bool((got.argmax(1) == want.argmax(1)).all())}))
"""


@test_quant_matmul.pytestmark  # OpenBLAS, the BLAS forward, AVX2 + FMA
def test_the_server_decodes_q6_k_matrices_from_their_codes(synthetic_files, tmp_path):
    """As served on the CPU (forward preloaded): every matrix of the Q4_K_M file, its
    Q6_K head, value and down projections included, has codes; decode logits stay at
    the int8 activations' distance from the float64 reference."""
    report = test_quant_matmul._run_child(
        SERVED_CHECK, str(synthetic_files["Q4_K_M"]),
        env={"VELOXQUANT_HOME": str(tmp_path)})
    products = 7 * report["layers"] + 1  # q, k, v, o, gate, up, down a layer; the head
    matrices = products + 1  # and the (Q4_K) embedding, which no product reads
    assert report["registered"] == matrices, report
    assert f"quantized codes of {matrices} matrices" in report["weights"], report
    assert report["served"] == products * 8, report  # every product of the 8 steps
    # int8 activations on this random 256-wide model: 0.043 of 3.49 (0.25 while the bias
    # term took x's exact sums; the kernel's own math: tests/test_quant_matmul.py).
    assert report["max_diff"] < 0.03 * report["scale"], report
    assert report["same_argmax"], report
