"""A block's decode call as two native operations (veloxquant_mlx/codes_decode.py).

``block_qkv`` and ``block_mlp`` must compute what the block's MLX ops compute (rms_norm,
the codes products, bias, head norms, RoPE; the residuals, silu * up) up to float32
rounding, for one row or many, shared or per-row RoPE tables; refuse bad shapes with a
ValueError that says what is wrong; and a model whose blocks take them must decode the
same logits as its compiled halves while rows join and leave, with two nodes a layer; and
a short prompt chunk through them must give the blocks' own logits, with two nodes a layer too.
"""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.memory.test_paged_batch import _arena, _joins_and_leaves, _paged, _prompt
from veloxquant_mlx.codes_decode import PROMPT_MAX_POSITIONS, CodesDecode
from veloxquant_mlx.codes_linear import INT8_MAX_ROWS, CodesLinear, layer_parts, use_codes
from veloxquant_mlx.compiled_decode import DecodeHalves, compile_decode_blocks
from veloxquant_mlx.kernels.build import KernelBuildError, load
from veloxquant_mlx.llama_model import own_model
from veloxquant_mlx.memory.request_blocks import make_batch_caches
from veloxquant_mlx.shared_rope import shared_rope

try:
    EXT = load()
except KernelBuildError as exc:  # no cmake / C++ compiler / nanobind here
    pytest.skip(f"the native operations cannot be built here: {exc}", allow_module_level=True)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INNER = 128, 4, 2, 32, 192


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def codes_layer(rows: int, cols: int, bits: int = 4, seed: int = 0) -> CodesLinear:
    mx.random.seed(seed)
    linear = nn.QuantizedLinear.from_linear(nn.Linear(cols, rows, bias=False),
                                            group_size=32, bits=bits)
    return CodesLinear(layer_parts(linear))


def weight(layer: CodesLinear) -> tuple:
    return (layer.weight, layer.scales, layer.biases, layer.bits, layer.group)


def tables(offsets: list[int], dims: int, traditional: bool):
    rope = shared_rope(nn.RoPE(dims, traditional=traditional, base=10000.0))
    offset = mx.array(offsets) if len(offsets) > 1 else mx.array(offsets[0])
    return rope.tables(offset, 1)


def qkv_reference(x, norm, layer, offsets, dims, traditional, bias=None, head_norms=None):
    """The block's own MLX ops: rms_norm, the codes product, heads, head norms, RoPE."""
    rows = x.shape[0]
    y = layer(mx.fast.rms_norm(x, norm, 1e-5))
    if bias is not None:
        y = y + bias
    q = y[:, :HEADS * HEAD_DIM].reshape(rows, HEADS, 1, HEAD_DIM)
    k = y[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].reshape(rows, KV_HEADS, 1, HEAD_DIM)
    v = y[:, (HEADS + KV_HEADS) * HEAD_DIM:].reshape(rows, KV_HEADS, 1, HEAD_DIM)
    if head_norms is not None:
        q, k = (mx.fast.rms_norm(t, w, 1e-6) for t, w in zip((q, k), head_norms, strict=True))
    offset = mx.array(offsets) if len(offsets) > 1 else offsets[0]
    q, k = (mx.fast.rope(t, dims, traditional=traditional, base=10000.0, scale=1.0,
                         offset=offset) for t in (q, k))
    return q, mx.concatenate([k, v])


@pytest.mark.parametrize("rows", [1, 3, INT8_MAX_ROWS + 4])
@pytest.mark.parametrize(("dims", "traditional", "extras"), [
    (HEAD_DIM, False, ()), (HEAD_DIM, True, ("bias",)), (HEAD_DIM // 2, False, ("norms",)),
])
def test_block_qkv_matches_the_blocks_ops(rows, dims, traditional, extras):
    mx.random.seed(rows)
    layer = codes_layer((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, seed=rows)
    x = mx.random.normal((rows, 1, HIDDEN))
    norm = 1.0 + 0.1 * mx.random.normal((HIDDEN,))
    bias = mx.random.normal((layer.weight.shape[0],)) if "bias" in extras else None
    norms = (1.0 + 0.1 * mx.random.normal((HEAD_DIM,)), mx.random.normal((HEAD_DIM,))) \
        if "norms" in extras else None
    offsets = [7 + 5 * r for r in range(rows)] if rows > 1 else [11]
    cos, sin = tables(offsets, dims, traditional)
    heads = {"q_norm": norms[0], "k_norm": norms[1], "head_eps": 1e-6} if norms else {}
    q, kv = EXT.block_qkv(x, norm, weight(layer), cos, sin, eps=1e-5, heads=HEADS,
                          kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_dims=dims,
                          traditional=traditional, bias=bias, float32_above=INT8_MAX_ROWS,
                          **heads)
    want_q, want_kv = qkv_reference(x.reshape(rows, HIDDEN), norm, layer, offsets, dims,
                                    traditional, bias, norms)
    assert q.shape == (rows, HEADS, 1, HEAD_DIM) and kv.shape == (2 * rows, KV_HEADS, 1, HEAD_DIM)
    assert rel_err(q, want_q) < 1e-5 and rel_err(kv, want_kv) < 1e-5


def test_block_qkv_takes_one_shared_table_for_every_row():
    layer = codes_layer((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, seed=3)
    x, norm = mx.random.normal((3, HIDDEN)), mx.ones((HIDDEN,))
    cos, sin = tables([9], HEAD_DIM, False)
    shared = EXT.block_qkv(x, norm, weight(layer), cos, sin, eps=1e-5, heads=HEADS,
                           kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_dims=HEAD_DIM)
    cos, sin = tables([9, 9, 9], HEAD_DIM, False)
    per_row = EXT.block_qkv(x, norm, weight(layer), cos, sin, eps=1e-5, heads=HEADS,
                            kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_dims=HEAD_DIM)
    assert all(mx.array_equal(a, b) for a, b in zip(shared, per_row, strict=True))


@pytest.mark.parametrize("rows", [1, 5, INT8_MAX_ROWS + 1])
@pytest.mark.parametrize("bits", [4, 8])
def test_block_mlp_matches_the_blocks_ops(rows, bits):
    mx.random.seed(bits + rows)
    o = codes_layer(HIDDEN, HEADS * HEAD_DIM, bits, seed=1)
    gate_up = codes_layer(2 * INNER, HIDDEN, bits, seed=2)
    down = codes_layer(HIDDEN, INNER, bits, seed=3)
    x = mx.random.normal((rows, 1, HIDDEN))
    attended = mx.random.normal((rows, HEADS, 1, HEAD_DIM))
    norm = 1.0 + 0.1 * mx.random.normal((HIDDEN,))
    got = EXT.block_mlp(x, attended, weight(o), norm, weight(gate_up), weight(down), eps=1e-5,
                        float32_above=INT8_MAX_ROWS)
    h = x + o(attended.reshape(rows, 1, -1))
    gate, up = mx.split(gate_up(mx.fast.rms_norm(h, norm, 1e-5)), 2, axis=-1)
    want = h + down(nn.silu(gate) * up)
    assert got.shape == x.shape
    assert rel_err(got, want) < 1e-5


def test_views_are_read_in_their_order():
    """A transposed attention output and a sliced x give what their copies give."""
    o = codes_layer(HIDDEN, HEADS * HEAD_DIM, seed=4)
    gate_up, down = codes_layer(2 * INNER, HIDDEN, seed=5), codes_layer(HIDDEN, INNER, seed=6)
    wide = mx.random.normal((2, 1, 2 * HIDDEN))
    attended = mx.random.normal((2, 1, HEADS, HEAD_DIM)).transpose(0, 2, 1, 3)
    args = (weight(o), mx.ones((HIDDEN,)), weight(gate_up), weight(down))
    viewed = EXT.block_mlp(wide[..., :HIDDEN], attended, *args, eps=1e-5)
    copied = EXT.block_mlp(mx.array(np.array(wide[..., :HIDDEN])),
                           mx.array(np.array(attended)), *args, eps=1e-5)
    assert mx.array_equal(viewed, copied)


def _bad_calls():
    qkv = weight(codes_layer((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, seed=7))
    cos, sin = tables([3], HEAD_DIM, False)
    x, norm = mx.zeros((2, HIDDEN)), mx.ones((HIDDEN,))
    shape = {"eps": 1e-5, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
             "rope_dims": HEAD_DIM}
    o, down = weight(codes_layer(HIDDEN, HEADS * HEAD_DIM)), weight(codes_layer(HIDDEN, INNER))
    gate_up = weight(codes_layer(2 * INNER, HIDDEN))
    attended = mx.zeros((2, HEADS * HEAD_DIM))
    return [
        (lambda: EXT.block_qkv(x, mx.ones((HIDDEN - 1,)), qkv, cos, sin, **shape),
         "norm's weight"),
        (lambda: EXT.block_qkv(x, norm, qkv, cos, sin, **{**shape, "heads": HEADS + 1}),
         "q/k/v codes"),
        (lambda: EXT.block_qkv(x, norm, qkv, cos[:, :3], sin, **shape), "cos and sin"),
        (lambda: EXT.block_qkv(x, norm, qkv, cos, sin, **{**shape, "rope_dims": 7}),
         "rope_dims"),
        (lambda: EXT.block_qkv(x, norm, qkv, cos, sin, q_norm=mx.ones((HEAD_DIM,)), **shape),
         "both head norms"),
        (lambda: EXT.block_qkv(mx.zeros((2, HIDDEN + 32)), mx.ones((HIDDEN + 32,)), qkv, cos,
                               sin, **shape), "columns a row"),
        (lambda: EXT.block_mlp(x, attended, o, norm, gate_up, gate_up, eps=1e-5), "down's"),
        (lambda: EXT.block_mlp(x, mx.zeros((3, 5)), o, norm, gate_up, down, eps=1e-5),
         "as many rows"),
        (lambda: EXT.block_mlp(x, attended, down, norm, gate_up, down, eps=1e-5),
         "block_mlp (o)"),
    ]


@pytest.mark.parametrize("index", range(9))
def test_bad_shapes_raise_value_error_saying_what(index):
    call, words = _bad_calls()[index]
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")
                       .replace("/", "/")):
        call()


# ------------------------------------------------------------------ in a model


def _codes_pair(module_name: str = "llama", **extra):
    """Two same-weight quantized models of an mlx-lm family, layers as codes, both with
    compiled decode: native block operations in the second only."""
    import importlib

    family = importlib.import_module(f"mlx_lm.models.{module_name}")
    args = family.ModelArgs(model_type=module_name, hidden_size=HIDDEN, num_hidden_layers=3,
                            intermediate_size=INNER, num_attention_heads=HEADS,
                            rms_norm_eps=1e-5, vocab_size=300, num_key_value_heads=KV_HEADS,
                            **extra)
    mx.random.seed(0)
    models = [family.Model(args), family.Model(args)]
    models[1].update(models[0].parameters())
    out = []
    for model, native in zip(models, (False, True), strict=True):
        nn.quantize(model, group_size=32, bits=4)
        use_codes(model)
        model = own_model(model)
        assert compile_decode_blocks(model, codes_blocks=native) == 3
        out.append(model)
    return out


def test_a_codes_models_blocks_decode_natively_with_two_nodes_a_layer():
    halves, native = _codes_pair()
    assert all(isinstance(b.decode, DecodeHalves) for b in halves.layers)
    assert all(isinstance(b.decode, CodesDecode) for b in native.layers)
    arena = _arena(native)
    batch, out = _paged(native, arena, [_prompt(1, 20)], 1)
    mx.eval(out, arena.data)  # the prompt's graph done: what follows is one step's
    from benchmark_scripts.benchmark_write_back import count_nodes

    logits = native(mx.argmax(out[0][0], -1)[:, None], cache=batch.caches)
    nodes = count_nodes([logits])
    assert nodes["BlockQkv"] == nodes["BlockMlp"] == 3
    assert nodes.get("CodesMatmul", 0) == 1  # the LM head's alone
    batch.release()


@pytest.mark.parametrize("write_back", [1, 8])
def test_decode_logits_match_the_compiled_halves_while_rows_join_and_leave(write_back):
    """Equal to rounding: a row's error stays at float32's (~1e-5) unless a value its
    int8 activations round lands on the other side of a rounding boundary; that moves
    one activation by one int8 step (~1% of this random model's logits, kept in the
    row's stored KV), so a few rows may carry it."""
    runs = [_joins_and_leaves(model, _arena(model, n_blocks=4096), random.Random(3), 24,
                              join_p=0.4, leave_p=0.25, fast=True, write_back=write_back)
            for model in _codes_pair()]
    errors = []
    for want, got in zip(*runs, strict=True):
        assert (want is None) == (got is None)
        if want is not None:
            assert want[0] == got[0]
            errors += [rel_err(g, w) for g, w in zip(got[1], want[1], strict=True)]
    assert len(errors) > 50
    assert max(errors) < 0.03
    assert np.mean(np.array(errors) < 1e-4) > 0.5, errors


# The Llama-shaped families: plain, a q/k/v bias (qwen2), q_norm / k_norm per head (qwen3).
FAMILIES = [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": HEAD_DIM, "max_position_embeddings": 512, "rope_theta": 10000.0,
               "tie_word_embeddings": True}),
]


@pytest.mark.parametrize(("family", "extra"), FAMILIES)
def test_every_family_decodes_natively_with_the_same_logits(family, extra):
    """More rows than INT8_MAX_ROWS: the products are float32, so no int8 rounding
    boundary can amplify a rounding difference and every row must agree (left padding,
    per-row RoPE positions, a bias, head norms)."""
    halves, native = _codes_pair(family, **extra)
    assert all(isinstance(b.decode, CodesDecode) for b in native.layers)
    prompts = [_prompt(seed, 3 + seed % 17) for seed in range(INT8_MAX_ROWS + 4)]
    runs = []
    for model in (halves, native):
        batch, out = _paged(model, _arena(model, n_blocks=4096), prompts, 4)
        runs.append(np.array(mx.concatenate([mx.stack(rows) for rows in out])))
        batch.release()
    assert EXT.float32_available()  # else the products would round x to int8
    assert max(rel_err(g, w) for g, w in zip(runs[1], runs[0], strict=True)) < 1e-4


def test_blocks_that_are_not_all_codes_keep_their_compiled_halves(tiny_model_path):
    import mlx_lm

    model = own_model(mlx_lm.load(str(tiny_model_path))[0])  # float weights
    assert compile_decode_blocks(model) == len(model.layers)
    assert all(isinstance(b.decode, DecodeHalves) for b in model.layers)


# ------------------------------------------------------------------ prompt chunks

def _prompt_errors(model, prompts, fast):
    """Per row, the relative errors of its logits after its prompt and after two decodes
    over the KV it stored, prompt operations on against off."""
    saved = [block.prompt for block in model.layers]
    assert all(p is not None for p in saved)
    runs = []
    for on in (False, True):
        for block, prompt in zip(model.layers, saved, strict=True):
            block.prompt = prompt if on else None
        batch, out = _paged(model, _arena(model, n_blocks=4096), prompts, 3, fast=fast)
        runs.append([[np.array(logits) for logits in row] for row in out])
        batch.release()
    return [[rel_err(g, w) for g, w in zip(got, want, strict=True)]
            for got, want in zip(runs[1], runs[0], strict=True)]


@pytest.mark.parametrize(("family", "extra"), FAMILIES)
@pytest.mark.parametrize(("widths", "fast"), [((9,), True), ((3, 7), False), ((3, 7), True)])
def test_a_short_prompt_runs_natively_with_the_blocks_logits(family, extra, widths, fast):
    """A prompt of at most PROMPT_MAX_POSITIONS (one row, or left-padded rows with
    per-row RoPE positions) takes int8 products both ways, as do the decodes over the
    KV it stored: equal to rounding, unless a rounding difference moves one int8
    activation a step (~1% of a row's logits, see the decode test above). A wrong
    position, head or column would be ~100%."""
    _, native = _codes_pair(family, **extra)
    assert len(widths) * max(widths) <= PROMPT_MAX_POSITIONS
    errors = _prompt_errors(native, [_prompt(seed, n) for seed, n in enumerate(widths)], fast)
    assert max(e for row in errors for e in row) < 0.03, errors


def test_a_prompt_chunk_is_two_nodes_a_layer_and_its_last_block_one_column():
    from benchmark_scripts.benchmark_write_back import count_nodes

    _, native = _codes_pair()
    arena = _arena(native)
    batch = make_batch_caches(native, arena, [1, 2], [0, 3], fast_attention=True)
    x = mx.array([_prompt(1, 8), [0] * 3 + _prompt(2, 5)])  # 16 positions
    every = native.model(x, batch.caches)
    nodes = count_nodes([every])
    assert nodes["BlockQkv"] == nodes["BlockMlp"] == 3
    assert "CodesMatmul" not in nodes  # every product inside the two operations
    mx.eval(every, arena.data)
    batch.release()
    batch = make_batch_caches(native, arena, [3, 4], [0, 3], fast_attention=True)
    last = native.model(x, batch.caches, last_column=True)
    assert count_nodes([last])["BlockMlp"] == 3
    assert last.shape == (2, 1, HIDDEN)
    assert rel_err(last, every[:, -1:]) < 0.03  # int8 products of 2 rows, not 16
    batch.release()


def test_a_prompt_chunk_of_more_positions_runs_the_blocks_own_ops():
    from benchmark_scripts.benchmark_write_back import count_nodes

    _, native = _codes_pair()
    arena = _arena(native, n_blocks=4096)
    n = PROMPT_MAX_POSITIONS // 2 + 1
    batch = make_batch_caches(native, arena, [1, 2], [0, 0], fast_attention=True)
    nodes = count_nodes([native.model(mx.array([_prompt(1, n), _prompt(2, n)]),
                                      batch.caches)])
    assert "BlockQkv" not in nodes and "BlockMlp" not in nodes
    assert nodes["CodesMatmul"] >= 3 * 4  # q/k/v, o, gate/up, down a layer
    batch.release()
