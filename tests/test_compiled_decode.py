"""Decode calls through compiled block halves (veloxquant_mlx/compiled_decode.py).

Compiling must change nothing a model computes: the logits of decode steps
bit for bit those of mlx-lm's own blocks while rows join and leave (with and
without write-back, on both attention paths), prompts and stock caches
untouched, the parameter tree as mlx-lm built it; and the server's runner
generates the same tokens with it on and off.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from server.engine.runner import ModelRunner
from server.protocol import SamplingParams
from tests.memory.test_paged_batch import _arena, _joins_and_leaves, _paged, _prompt, _stock
from veloxquant_mlx import compiled_decode
from veloxquant_mlx.compiled_decode import compile_decode_blocks
from veloxquant_mlx.llama_model import own_model


def _load(path):
    import mlx_lm

    return own_model(mlx_lm.load(str(path))[0])


@pytest.fixture(scope="module")
def plain(tiny_model_path):
    return _load(tiny_model_path)


@pytest.fixture(scope="module")
def compiled(tiny_model_path):
    model = _load(tiny_model_path)
    assert compile_decode_blocks(model) == len(model.layers)
    return model


@pytest.mark.parametrize(("fast", "write_back"), [(False, 1), (True, 1), (False, 8), (True, 8)])
@pytest.mark.slow
def test_decode_logits_are_bit_identical_while_rows_join_and_leave(plain, compiled, fast,
                                                                   write_back):
    runs = [_joins_and_leaves(model, _arena(model, n_blocks=4096), random.Random(5), 30,
                              join_p=0.4, leave_p=0.25, fast=fast, write_back=write_back)
            for model in (plain, compiled)]
    assert len(runs[0]) == len(runs[1]) == 30
    for want, got in zip(*runs, strict=True):
        assert (want is None) == (got is None)
        if want is not None:
            assert want[0] == got[0]
            assert np.array_equal(want[1], got[1])


def test_blocks_share_one_pair_and_keep_mlx_lm_parameters(plain, compiled):
    assert {id(block.decode.halves) for block in compiled.layers} == {
        id(compiled.layers[0].decode.halves)}
    assert [n for n, _ in tree_flatten(compiled.parameters())] == [
        n for n, _ in tree_flatten(plain.parameters())]
    # A decode call traces with the weights swapped in; the template gets its own back.
    template = compiled.layers[0].decode.halves.template
    before = [id(w) for _, w in tree_flatten(template.parameters())]
    batch, _ = _paged(compiled, _arena(compiled), [_prompt(1, 20), _prompt(2, 9)], 3)
    batch.release()
    assert [id(w) for _, w in tree_flatten(template.parameters())] == before


def test_prompts_and_stock_caches_run_the_blocks_as_written(plain, compiled, monkeypatch):
    calls = []
    real = compiled_decode._Halves.__call__
    monkeypatch.setattr(compiled_decode._Halves, "__call__",
                        lambda self, *a: (calls.append(1), real(self, *a))[1])
    for want, got in zip(_stock(plain, _prompt(3, 30), 4), _stock(compiled, _prompt(3, 30), 4),
                         strict=True):
        assert mx.array_equal(want, got)
    assert not calls  # a stock KVCache: mlx-lm's block
    batch, _ = _paged(compiled, _arena(compiled), [_prompt(4, 30)], 0)  # a prompt only
    batch.release()
    assert not calls
    batch, _ = _paged(compiled, _arena(compiled), [_prompt(4, 30)], 2)
    batch.release()
    assert len(calls) == 2 * len(compiled.layers)  # its two one-column calls


def test_bfloat16_decode_is_bit_identical(tiny_model_path):
    """The dtype a GPU serves in (mlx-lm's attention; fused elementwise ops in bfloat16)."""
    pair = [_load(tiny_model_path) for _ in range(2)]
    for model in pair:
        model.set_dtype(mx.bfloat16)
    assert compile_decode_blocks(pair[1]) == len(pair[1].layers)
    runs = []
    for model in pair:
        batch, out = _paged(model, _arena(model), [_prompt(7, 25), _prompt(8, 14)], 6)
        runs.append(mx.concatenate([mx.stack(rows) for rows in out]))
        batch.release()
    assert runs[0].dtype == mx.bfloat16
    assert mx.array_equal(*runs)


def _random_pair(module_name: str, **extra):
    """Two same-weight random models of an mlx-lm family; the second compiled."""
    import importlib

    family = importlib.import_module(f"mlx_lm.models.{module_name}")
    args = family.ModelArgs(model_type=module_name, hidden_size=64, num_hidden_layers=3,
                            intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                            vocab_size=300, num_key_value_heads=2, **extra)
    first, second = family.Model(args), family.Model(args)
    second.update(first.parameters())
    mx.eval(first.parameters())
    first, second = own_model(first), own_model(second)
    return first, second, compile_decode_blocks(second)


@pytest.mark.parametrize(("family", "extra"), [
    ("qwen2", {}),
    ("qwen3", {"head_dim": 16, "max_position_embeddings": 512, "rope_theta": 10000.0,
               "tie_word_embeddings": True}),  # q_norm / k_norm per head
])
def test_qwen_blocks_compile_with_the_same_logits(family, extra):
    plain_q, compiled_q, count = _random_pair(family, **extra)
    assert count == 3
    prompts = [_prompt(5, 12), _prompt(6, 7)]
    runs = []
    for model in (plain_q, compiled_q):
        batch, out = _paged(model, _arena(model), prompts, 4)
        runs.append(mx.concatenate([mx.stack(rows) for rows in out]))
        batch.release()
    assert mx.array_equal(*runs)


def test_other_block_shapes_are_left_alone():
    _, model, count = _random_pair("gemma", head_dim=16)
    assert count == 0
    assert type(model.layers[0]).__module__ == "mlx_lm.models.gemma"  # mlx-lm's, untouched


def _runner_tokens(model, compile_decode: bool) -> dict[int, list[int]]:
    arena = _arena(model)
    runner = ModelRunner(model, arena.pool, 16, arena, kv_write_back=4,
                         compile_decode=compile_decode)
    assert runner.compiled_blocks == (len(model.layers) if compile_decode else 0)
    for owner, n in ((1, 20), (2, 33)):
        runner.add(owner, _prompt(owner, n), SamplingParams(max_tokens=40, temperature=0.0))
    got: dict[int, list[int]] = {1: [], 2: [], 3: []}
    for step in range(16):
        if step == 5:  # a third request joins mid-way
            runner.add(3, _prompt(3, 11), SamplingParams(max_tokens=40, temperature=0.0))
        for out in (runner.prefill(1 << 12), runner.decode()):
            for sampled in out.tokens:
                got[sampled.owner].append(sampled.token)
    runner.remove([1, 2, 3])
    assert arena.pool.stats.blocks_in_use() == 0
    return got


def test_the_runner_generates_the_same_tokens_compiled(plain, compiled):
    want, got = _runner_tokens(plain, False), _runner_tokens(compiled, True)
    assert all(len(tokens) >= 8 for tokens in want.values())
    assert want == got
