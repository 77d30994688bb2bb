"""Sibling projections as one matmul (veloxquant_mlx/fused_projections.py).

Fusing must change neither what a layer computes nor how much memory the
weights take: each member's output bit for bit what it was, its parameters
the same values (now views of the stacked buffer), the active memory the
same; layers that cannot stack are left alone; a fused, compiled model
decodes the logits of the plain one (plain and quantized weights); layers
computing from their codes (CodesLinear, the CPU's quantized layers) fuse too;
and the server fuses unless batch.fuse_projections is off.
"""

from __future__ import annotations

import gc
import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from server.engine.engine import Engine
from server.metrics import ServerMetrics
from server.model_loader import load_model
from tests.memory.test_paged_batch import _arena, _joins_and_leaves, _paged, _prompt
from tests.support.servers import make_settings
from veloxquant_mlx.compiled_decode import compile_decode_blocks, fused_of
from veloxquant_mlx.fused_projections import fusable, fuse_block, fuse_group
from veloxquant_mlx.llama_model import own_model


def _layers(sizes, bias=False, quantize=False, dims=64):
    layers = [nn.Linear(dims, n, bias=bias) for n in sizes]
    if quantize:
        layers = [nn.QuantizedLinear.from_linear(layer, group_size=32, bits=4)
                  for layer in layers]
    mx.eval([layer.parameters() for layer in layers])
    return layers


@pytest.mark.parametrize(("bias", "quantize"), [(False, False), (True, False), (False, True)])
def test_each_member_computes_what_it_did_from_one_matmul(bias, quantize):
    layers = _layers([64, 16, 16], bias=bias, quantize=quantize)
    x = mx.random.normal((5, 64), key=mx.random.key(1))
    want = [layer(x) for layer in layers]
    before = [tree_flatten(layer.parameters()) for layer in layers]  # arrays are immutable
    fused = fuse_group(layers)
    got = fused(x)
    assert fused.sizes == [64, 16, 16]
    assert [g.shape for g in got] == [(5, 64), (5, 16), (5, 16)]
    for w, g in zip(want, got, strict=True):
        assert mx.array_equal(w, g)
    for layer, params in zip(layers, before, strict=True):  # the same values, now views
        now = tree_flatten(layer.parameters())
        assert [k for k, _ in now] == [k for k, _ in params]
        assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(now, params, strict=True))
    for w, layer in zip(want, layers, strict=True):  # the members' own calls too
        assert mx.array_equal(w, layer(x))


def test_fusing_keeps_one_copy_of_the_weights():
    layers = _layers([512, 128, 128], dims=256)  # ~0.4 MB: well above allocator noise
    weight_bytes = sum(layer.weight.nbytes for layer in layers)
    gc.collect()
    before = mx.get_active_memory()
    fused = fuse_group(layers)
    gc.collect()
    after = mx.get_active_memory()
    assert abs(after - before) < weight_bytes // 10, (before, after, weight_bytes)
    assert fused.module.weight.shape == (768, 256)


def test_layers_that_cannot_stack_are_left_alone():
    plain, quantized = _layers([32]), _layers([32], quantize=True)
    assert not fusable([plain[0], quantized[0]])  # two classes
    assert not fusable(_layers([32], dims=64) + _layers([32], dims=32))  # input widths
    assert not fusable([plain[0], _layers([32], bias=True)[0]])  # one has a bias
    assert not fusable([nn.Embedding(10, 8), nn.Embedding(10, 8)])  # not a projection
    with pytest.raises(ValueError, match="only layers of one plain"):
        fuse_group([plain[0], quantized[0]])

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = nn.Module()
            self.self_attn.q_proj, self.self_attn.k_proj = _layers([32, 16])
            self.self_attn.v_proj = _layers([16], dims=32)[0]  # another input width
            self.mlp = nn.Module()
            self.mlp.gate_proj, self.mlp.up_proj = _layers([48, 48])

    block = Block()
    weight = block.self_attn.q_proj.weight
    assert sorted(fuse_block(block)) == ["mlp"]
    assert block.self_attn.q_proj.weight is weight  # untouched


def _tiny_pair(tiny_model_path, quantize=False):
    import mlx_lm

    models = [own_model(mlx_lm.load(str(tiny_model_path))[0]) for _ in range(2)]
    if quantize:
        for model in models:
            nn.quantize(model, group_size=32, bits=4)
            mx.eval(model.parameters())
    return models


def _assert_same_decode(plain, fused) -> None:
    """Both models decode the same tokens and bit-identical logits through joins and leaves."""
    runs = [_joins_and_leaves(model, _arena(model, n_blocks=4096), random.Random(3), 16,
                              join_p=0.4, leave_p=0.25, fast=False, write_back=4)
            for model in (plain, fused)]
    for want, got in zip(*runs, strict=True):
        assert (want is None) == (got is None)
        if want is not None:
            assert want[0] == got[0]
            assert np.array_equal(want[1], got[1])


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.slow
def test_a_fused_compiled_model_decodes_the_plain_logits(tiny_model_path, quantize):
    plain, fused = _tiny_pair(tiny_model_path, quantize)
    names = [n for n, _ in tree_flatten(fused.parameters())]
    assert compile_decode_blocks(fused, fuse_projections=True) == len(fused.layers)
    assert all(sorted(fused_of(b)) == ["mlp", "self_attn"] for b in fused.layers)
    assert [n for n, _ in tree_flatten(fused.parameters())] == names  # mlx-lm's tree
    _assert_same_decode(plain, fused)
    # Prompts run the blocks' plain calls on the members' views: the same logits too.
    outs = []
    for model in (plain, fused):
        batch, out = _paged(model, _arena(model), [_prompt(9, 21)], 1)
        outs.append(mx.stack(out[0]))
        batch.release()
    assert mx.array_equal(*outs)


def test_unfused_compiled_blocks_keep_separate_projections(tiny_model_path):
    _, model = _tiny_pair(tiny_model_path)
    weight = model.layers[0].self_attn.q_proj.weight
    assert compile_decode_blocks(model, fuse_projections=False) == len(model.layers)
    assert all(fused_of(b) == {} for b in model.layers)
    assert model.layers[0].self_attn.q_proj.weight is weight


def _engine_fused(settings, loader) -> list[dict]:
    engine = Engine(settings, ServerMetrics(), loader=loader)
    engine.start()
    try:
        assert engine.wait_ready(120)
        return [fused_of(block) for block in engine.steps.runner.model.layers]
    finally:
        engine.stop()


def _codes_model(tiny_model_path):
    """The tiny model quantized (4 bits, groups of 32) and computing from its codes."""
    import mlx_lm

    from veloxquant_mlx.codes_linear import use_codes
    from veloxquant_mlx.kernels.build import KernelBuildError, load

    try:
        load()
    except KernelBuildError as exc:
        pytest.skip(f"the codes_matmul extension cannot be built here: {exc}")
    model = mlx_lm.load(str(tiny_model_path))[0]
    nn.quantize(model, group_size=32, bits=4)
    assert use_codes(model) == 7 * len(model.layers) + 1  # and the embedding
    return own_model(model)


@pytest.mark.parametrize("rows", [1, 5, 40])  # decode, a small batch, a prompt's chunk
def test_codes_layers_fuse_and_compute_what_they_did(tiny_model_path, rows):
    from veloxquant_mlx.codes_linear import CodesLinear

    model = _codes_model(tiny_model_path)
    block = model.layers[0]
    members = {"self_attn": [block.self_attn.q_proj, block.self_attn.k_proj,
                             block.self_attn.v_proj],
               "mlp": [block.mlp.gate_proj, block.mlp.up_proj]}
    assert all(type(m) is CodesLinear for group in members.values() for m in group)
    x = mx.random.normal((2, rows, model.args.hidden_size), key=mx.random.key(rows))
    want = {name: [layer(x) for layer in group] for name, group in members.items()}
    mx.eval(want)
    fused = fuse_block(block)
    assert sorted(fused) == ["mlp", "self_attn"]
    assert type(fused["mlp"].module) is CodesLinear
    assert fused["self_attn"].module.weight.dtype == mx.uint8
    for name, group in members.items():
        got = fused[name](x)
        for w, g, layer in zip(want[name], got, group, strict=True):
            # A row's result does not depend on the weight rows stacked beside it.
            assert mx.array_equal(w, g), name
            assert mx.array_equal(w, layer(x)), name  # the members' own calls on the views


@pytest.mark.slow
def test_a_fused_compiled_codes_model_decodes_the_unfused_logits(tiny_model_path):
    plain, fused = (_codes_model(tiny_model_path) for _ in range(2))
    assert compile_decode_blocks(plain, fuse_projections=False) == len(plain.layers)
    # The compiled halves both ways: fusing alone must change nothing (the native block
    # operations a fused codes block would take are tests/test_codes_decode.py's).
    assert compile_decode_blocks(fused, fuse_projections=True,
                                 codes_blocks=False) == len(fused.layers)
    assert all(sorted(fused_of(b)) == ["mlp", "self_attn"] for b in fused.layers)
    _assert_same_decode(plain, fused)


def test_the_server_fuses_unless_the_setting_is_off(tiny_model_path):
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 512})
    assert all(sorted(f) == ["mlp", "self_attn"] for f in _engine_fused(settings, load_model))
    off = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 512},
                        batch={"fuse_projections": False})
    assert all(f == {} for f in _engine_fused(off, load_model))


def test_the_server_fuses_a_model_served_from_its_codes(tiny_model_path):
    from veloxquant_mlx.codes_linear import CodesLinear

    def with_codes(section, codes=True):  # as load_model serves a quantized checkpoint
        loaded = load_model(section, codes=codes)
        loaded.model = _codes_model(tiny_model_path)
        loaded.codes_layers, loaded.quantized = 7 * len(loaded.model.layers) + 1, True
        return loaded

    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 512})
    engine = Engine(settings, ServerMetrics(), loader=with_codes)
    engine.start()
    try:
        assert engine.wait_ready(120), engine.load_error
        blocks = engine.steps.runner.model.layers
        assert all(sorted(fused_of(b)) == ["mlp", "self_attn"] for b in blocks)
        assert type(blocks[0].mlp.gate_up.module) is CodesLinear
    finally:
        engine.stop()
