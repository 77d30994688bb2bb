"""A Q4_K_M-style file as the server loads it: sizes, the float32 plan, and the codes kept.

The converted folder mixes 4-bit (Q4_K, float32 scales), 5-bit (Q5_0) and
float (Q6_K) matrices; the server's CPU plan must size, dequantize and serve
all three, and keep codes for the decode kernel of every quantized one.
"""

from __future__ import annotations

import math

import mlx_lm
import numpy as np
from gguf import GGUFReader

from server.model_loader import load_model
from server.model_weights import float32_bytes
from server.settings import ModelSection
from tests.gguf.reference import ReferenceModel
from tests.gguf.test_logits import SYNTH_PROMPT, TOLERANCE, mlx_logits
from veloxquant_mlx.quant_weights import capture_quantized_layers


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
