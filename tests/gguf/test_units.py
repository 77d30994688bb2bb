"""Focused checks of single pieces: BF16 exactness, un-permute, the atomic build."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from tests.gguf import synth
from veloxquant_mlx.gguf import read_header
from veloxquant_mlx.gguf.cache import build_atomically
from veloxquant_mlx.gguf.layout import rename, unpermute_rows
from veloxquant_mlx.gguf.weights import load_gguf_tensors


def test_bf16_values_outside_float16_range_survive(tmp_path):
    """mx.load would turn BF16 into float16 (inf above 65504, 0 below ~6e-8)."""
    values = np.array([[1e5, -3e38, 1e-10, 0.15625] * 8], dtype=np.float32)
    packed = quantize(values, synth.Q.BF16)
    path = synth.write_minimal(
        tmp_path / "bf16.gguf", tensors={"token_embd.weight": (packed, "BF16")}
    )
    loaded = load_gguf_tensors(read_header(path))[0]["token_embd.weight"]
    assert loaded.dtype == mx.bfloat16
    want = dequantize(packed, synth.Q.BF16)  # gguf's own BF16 decoding
    np.testing.assert_array_equal(np.array(loaded.astype(mx.float32)), want)
    assert np.abs(want[0, :3] / values[0, :3] - 1).max() < 1e-2  # really out of f16 range


def test_unpermute_inverts_llama_cpp_permute():
    x = mx.arange(4 * 16 * 3).reshape(4 * 16, 3)  # 4 heads of 16 rows, 3 columns
    permuted = x.reshape(4, 2, 8, 3).swapaxes(1, 2).reshape(x.shape)  # llama.cpp's permute
    assert mx.array_equal(unpermute_rows(permuted, 4), x)


@pytest.mark.parametrize(
    ("gguf_name", "mlx_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("token_embd.scales", "model.embed_tokens.scales"),
        ("output.weight", "lm_head.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("blk.12.attn_norm.weight", "model.layers.12.input_layernorm.weight"),
        ("blk.0.attn_q.biases", "model.layers.0.self_attn.q_proj.biases"),
        ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("blk.3.ffn_gate.weight", "model.layers.3.mlp.gate_proj.weight"),
        ("blk.3.ffn_up.weight", "model.layers.3.mlp.up_proj.weight"),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
        ("rope_freqs.weight", None),
        ("blk.0.attn_q.grid", None),
    ],
)
def test_rename(gguf_name, mlx_name):
    assert rename(gguf_name) == mlx_name


def test_build_atomically_keeps_a_concurrent_winner(tmp_path):
    target = tmp_path / "gguf" / "abc"

    def build(folder):
        (folder / "mine.txt").write_text("loser")
        target.mkdir()  # another process renamed its finished folder into place meanwhile
        (target / "theirs.txt").write_text("winner")

    assert build_atomically(target, build) == target
    assert [p.name for p in target.iterdir()] == ["theirs.txt"]
    assert [p.name for p in target.parent.iterdir()] == ["abc"]  # our temp folder is gone
