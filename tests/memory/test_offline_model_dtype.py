"""Stored weight dtypes of the offline models (the bfloat16 path the GPU preset uses)."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from veloxquant_mlx import offline_model
from veloxquant_mlx.offline_model import ModelPreset, build_info, build_model

# A tiny bfloat16 shape: the 1b preset's dtype path without its 2 GB of weights.
TINY_BF16 = ModelPreset("tiny-bf16", 64, 2, 4, 2, 128, 512, corpus_chars=200_000,
                        dtype="bfloat16")


def test_bfloat16_preset_writes_bf16_tensors_that_mlx_lm_loads(tmp_path):
    folder = build_model(TINY_BF16, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    weights = mx.load(str(folder / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.bfloat16}
    model, tokenizer = mlx_lm.load(str(folder))
    assert {w.dtype for _, w in tree_flatten(model.parameters())} == {mx.bfloat16}
    out = mlx_lm.generate(model, tokenizer, "def f", max_tokens=3)
    assert isinstance(out, str)


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype 'int8'"):
        ModelPreset("x", 64, 2, 4, 2, 128, 512, dtype="int8")


def test_float32_build_info_is_unchanged_by_the_dtype_field():
    # Folders whose build info names no dtype (float32) must stay current (no rebuild).
    assert "dtype" not in build_info(offline_model.PRESETS["tiny"], 0)["preset"]
    assert build_info(TINY_BF16, 0)["preset"]["dtype"] == "bfloat16"


def test_1b_preset_is_a_bf16_llama_3_2_1b_shape_of_about_1b_parameters():
    preset = offline_model.PRESETS["1b"]
    config = offline_model.model_config(preset, preset.vocab_size)
    assert (config["hidden_size"], config["num_hidden_layers"]) == (2048, 16)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (32, 8)
    assert (config["head_dim"], config["intermediate_size"]) == (64, 8192)
    assert config["torch_dtype"] == "bfloat16"
    # Lazy arrays: counting sizes draws no weights.
    model = llama.Model(llama.ModelArgs.from_dict(config))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 0.95e9 < n_params < 1.1e9
