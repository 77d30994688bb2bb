"""The converted model computes what the GGUF file means.

mlx-lm's forward pass over the converted folder (in float32) is compared with
an independent float64 NumPy forward pass over the dequantized GGUF weights
(:mod:`tests.gguf.reference`), which applies RoPE the llama.cpp way on the
stored, permuted q/k rows.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from tests.gguf import synth
from tests.gguf.reference import ReferenceModel

TOLERANCE = 1e-3
SYNTH_PROMPT = [0, 40, 75, 260, 120, 3, 279, 99]
# "<|im_start|>user\nWhat is the capital of France?" with the converted tokenizer.
SMOLLM2_PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47]


def mlx_logits(model, token_ids: list[int]) -> np.ndarray:
    """Logits of an mlx-lm model run in float32 (scales/biases cast, codes kept)."""
    model.set_dtype(mx.float32)
    logits = model(mx.array([token_ids]))[0]
    return np.array(logits.astype(mx.float32), dtype=np.float64)


def permute_like_llama_cpp(x: mx.array, n_head: int) -> mx.array:
    """llama.cpp's convert-time permutation of q/k rows (what the converter undoes)."""
    half = x.shape[0] // n_head // 2
    return x.reshape(n_head, 2, half, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def repermute_qk(model, n_head: int, n_kv: int) -> None:
    """Put q/k rows back into GGUF order in a loaded model (a converter without un-permute)."""
    for layer in model.model.layers:
        for proj, heads in ((layer.self_attn.q_proj, n_head), (layer.self_attn.k_proj, n_kv)):
            for key in ("weight", "scales", "biases"):
                if key in proj:
                    proj[key] = permute_like_llama_cpp(proj[key], heads)


@pytest.mark.parametrize("variant", list(synth.VARIANTS))
def test_synthetic_logits_match_reference(variant, synthetic_files, synthetic_converted):
    model, _ = mlx_lm.load(str(synthetic_converted[variant]))
    got = mlx_logits(model, SYNTH_PROMPT)
    want = ReferenceModel(synthetic_files[variant]).logits(SYNTH_PROMPT)
    assert got.shape == want.shape
    diff = np.abs(got - want).max()
    print(f"{variant}: max |diff| = {diff:.2e} (logit scale {np.abs(want).max():.1f})")
    assert diff <= TOLERANCE


def test_mixed_types_get_per_module_quantization(synthetic_converted):
    config = json.loads((synthetic_converted["mixed"] / "config.json").read_text())
    quant = config["quantization"]
    assert quant["group_size"] == 32 and quant["bits"] == 4
    assert quant["model.layers.0.mlp.down_proj"] == {"group_size": 32, "bits": 8}
    assert quant["lm_head"] is False
    assert quant["model.layers.1.self_attn.v_proj"] is False
    assert quant["model.layers.1.self_attn.k_proj"] is False
    assert "model.embed_tokens" not in quant  # Q4_1 is the 4-bit default
    assert config["tie_word_embeddings"] is False


def test_float_file_has_no_quantization_entry(synthetic_converted):
    config = json.loads((synthetic_converted["F32"] / "config.json").read_text())
    assert "quantization" not in config


@pytest.mark.parametrize("variant", ["Q8_0", "F32"])
def test_check_fails_without_unpermute(variant, synthetic_files, synthetic_converted):
    """Proof that the logits check can fail: skipping the un-permute breaks it."""
    model, _ = mlx_lm.load(str(synthetic_converted[variant]))
    repermute_qk(model, synth.N_HEAD, synth.N_HEAD_KV)
    got = mlx_logits(model, SYNTH_PROMPT)
    want = ReferenceModel(synthetic_files[variant]).logits(SYNTH_PROMPT)
    diff = np.abs(got - want).max()
    print(f"{variant} without un-permute: max |diff| = {diff:.2f}")
    assert diff > 100 * TOLERANCE


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path) -> np.ndarray:
    """Reference logits of SmolLM2 on the prompt (~5 s of float64 NumPy)."""
    return ReferenceModel(smollm2_path).logits(SMOLLM2_PROMPT)


@pytest.mark.slow
def test_smollm2_logits_match_reference(smollm2_folder, smollm2_reference):
    model, _ = mlx_lm.load(str(smollm2_folder))  # own copy: set_dtype must not leak
    got = mlx_logits(model, SMOLLM2_PROMPT)
    want = smollm2_reference
    diff = np.abs(got - want).max()
    print(f"SmolLM2: max |diff| = {diff:.2e} (logit scale {np.abs(want).max():.1f})")
    assert diff <= TOLERANCE
    # Same greedy next token at every position, the part generation depends on.
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
def test_smollm2_check_fails_without_unpermute(smollm2_folder, smollm2_reference):
    model, _ = mlx_lm.load(str(smollm2_folder))  # a private copy: it gets damaged
    repermute_qk(model, 9, 3)
    diff = np.abs(mlx_logits(model, SMOLLM2_PROMPT) - smollm2_reference).max()
    print(f"SmolLM2 without un-permute: max |diff| = {diff:.2f}")
    assert diff > 100 * TOLERANCE
