"""Decode calls whose rows all see every key get no mask (PagedKVBatch.maskless).

A GPU runs MLX's fused decode attention only for a call without an array
mask, so a one-column call whose rows all stored the same number of tokens
(and all see the call's own or held columns) passes none, with the stored
keys cut to exactly those tokens. Checked on the tiny model: what attention
is handed at every call (mask, key columns), and that the logits stay those
of mlx-lm's stock cache.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest

from tests.memory.test_paged_batch import BS, _arena, _prompt, _stock
from veloxquant_mlx.memory.request_blocks import make_batch_caches

ON_CPU = mx.default_device().type == mx.DeviceType.cpu


@pytest.fixture
def model(served_model):
    """The paged batch serves the project's model (its attention reads the parts)."""
    return served_model


def _same_logits(want: mx.array, have: mx.array) -> bool:
    """Bit for bit on the CPU; within float32-product noise on a GPU.

    A GPU picks its matmul kernel by shape (and may round float32 products to
    TF32), so a call of two rows need not repeat a one-row call's bits there:
    on an H200 they differ by up to ~6e-4 on logits of magnitude ~1.
    """
    if ON_CPU:
        return mx.array_equal(want, have).item()
    return mx.allclose(want, have, rtol=1e-2, atol=1e-2).item()


def _record_attention(model, monkeypatch) -> list[tuple[object, int]]:
    """(mask, key columns) of every attention call of ``model``'s module (the project's
    Llama-shaped model, whose blocks and compiled halves call it by its module name)."""
    module = sys.modules[type(model).__module__]
    real = module.scaled_dot_product_attention
    calls = []

    def recorded(queries, keys, values, cache, scale, mask):
        calls.append((mask, keys.shape[2]))
        return real(queries, keys, values, cache, scale, mask)

    monkeypatch.setattr(module, "scaled_dot_product_attention", recorded)
    return calls


def _decode(model, batch, prompts, steps):
    """Prefill ``prompts`` (same length), then ``steps`` greedy decode calls.

    Returns the logits each decode call was fed from (the prompt's, then each
    call's but the last).
    """
    logits = model(mx.array(prompts), cache=batch.caches)[:, -1]
    out = []
    for _ in range(steps):
        out.append(logits)
        logits = model(mx.argmax(logits, -1)[:, None], cache=batch.caches)[:, -1]
    return out


@pytest.mark.parametrize("write_back", [1, 8])
def test_one_row_decodes_without_a_mask_over_exactly_its_tokens(model, monkeypatch,
                                                                write_back):
    arena = _arena(model)
    prompt = _prompt(3, 21)  # not a whole number of blocks: the last one is part empty
    batch = make_batch_caches(model, arena, [1], fast_attention=False)
    batch.write_back = write_back
    calls = _record_attention(model, monkeypatch)
    got = _decode(model, batch, [prompt], 12)
    layers = len(model.layers)
    prefill, decodes = calls[:layers], calls[layers:]
    assert all(mask is not None for mask, _ in prefill)  # a prompt stays causal
    assert len(decodes) == 12 * layers
    for step in range(12):  # the call feeds token 21 + step: keys are every token so far
        for mask, columns in decodes[step * layers:(step + 1) * layers]:
            assert mask is None
            assert columns == len(prompt) + step + 1
    for want, have in zip(_stock(model, prompt, 12), got, strict=True):
        assert mx.array_equal(want, have)  # mlx-lm's own call: no mask, no padding
    batch.release()
    assert arena.pool.stats.blocks_in_use() == 0


def test_rows_of_equal_length_share_a_maskless_call(model, monkeypatch):
    arena = _arena(model)
    prompts = [_prompt(1, 20), _prompt(2, 20)]
    batch = make_batch_caches(model, arena, [1, 2], fast_attention=False)
    calls = _record_attention(model, monkeypatch)
    got = _decode(model, batch, prompts, 5)
    decodes = calls[len(model.layers):]
    assert decodes and all(mask is None for mask, _ in decodes)
    for i, prompt in enumerate(prompts):
        for want, have in zip(_stock(model, prompt, 5), got, strict=True):
            assert _same_logits(want, have[i: i + 1])
    batch.release()


def test_rows_of_unequal_length_keep_their_mask(model, monkeypatch):
    arena = _arena(model)
    short, long = _prompt(4, 7), _prompt(5, 33)
    batch = make_batch_caches(model, arena, [1, 2], [26, 0], fast_attention=False)
    calls = _record_attention(model, monkeypatch)
    _decode(model, batch, [[0] * 26 + short, long], 4)
    for mask, columns in calls[len(model.layers):]:
        assert isinstance(mask, mx.array) and mask.dtype == mx.bool_
        assert columns % BS == 1  # whole stored blocks plus the call's own column
    batch.release()


def test_a_row_joining_mid_hold_brings_the_mask_back(model, monkeypatch):
    """A joined row does not see the columns held before it came: masked."""
    arena = _arena(model)
    batch = make_batch_caches(model, arena, [1], fast_attention=False)
    batch.write_back = 8
    logits = _decode(model, batch, [_prompt(6, 20)], 3)[-1]
    joiner = make_batch_caches(model, arena, [2], fast_attention=False)
    first = model(mx.array([_prompt(6, 20)]), cache=joiner.caches)[:, -1]
    calls = _record_attention(model, monkeypatch)
    batch.extend(joiner)
    tokens = mx.argmax(mx.concatenate([logits, first]), -1)[:, None]
    model(tokens, cache=batch.caches)
    assert batch.held.start.tolist() == [0, batch.held.count - 1]
    assert all(isinstance(mask, mx.array) for mask, _ in calls)
    batch.release()
    assert arena.pool.stats.blocks_in_use() == 0


@pytest.mark.skipif(not ON_CPU, reason="paged_attention routes CPU calls only")
def test_fast_attention_takes_a_maskless_call_in_parts(model, monkeypatch):
    """The CPU path keeps the stored blocks whole (masked) and the new part unmasked."""
    from veloxquant_mlx.memory import paged_attention

    monkeypatch.setattr(paged_attention, "FAST_MIN_SCORES", 0)  # every call on that path
    monkeypatch.setattr(paged_attention, "NATIVE_MAX_SCORES", -1)  # decode calls too
    seen = []
    real = paged_attention.attention_parts

    def recorded(queries, keys, values, scale, masks, causal_last=False):
        seen.append(([k.shape[2] for k in keys], masks))
        return real(queries, keys, values, scale, masks, causal_last=causal_last)

    monkeypatch.setattr(paged_attention, "attention_parts", recorded)
    arena = _arena(model)
    prompt = _prompt(7, 21)
    batch = make_batch_caches(model, arena, [1], fast_attention=True)
    got = _decode(model, batch, [prompt], 6)
    decodes = seen[len(model.layers):]
    assert len(decodes) == 6 * len(model.layers)
    for widths, masks in decodes:
        assert widths[0] % BS == 0 and masks[1] is None  # whole blocks; own column unmasked
        assert isinstance(masks[0], mx.array)  # the last block's empty tail is masked
    for want, have in zip(_stock(model, prompt, 6), got, strict=True):
        assert mx.argmax(want, -1).item() == mx.argmax(have, -1).item()
        assert mx.abs(want - have).max().item() < 1e-5
    batch.release()
