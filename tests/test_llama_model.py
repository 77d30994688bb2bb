"""The project's own Llama-shaped forward pass (veloxquant_mlx/llama_model.py).

mlx-lm's modules are the reference: over the same weight modules, the owned model's
logits on stock caches are bit for bit mlx-lm's, for every family it runs (sliding
windows included), its parameter tree is mlx-lm's, and nothing in mlx-lm is modified
by owning, compiling or serving a model. Families it does not run stay mlx-lm's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import mlx_lm.models.activations as activations
import mlx_lm.models.base as base
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from tests.memory.test_paged_batch import _arena, _paged
from veloxquant_mlx.compiled_decode import compile_decode_blocks
from veloxquant_mlx.family_models import build_family_model
from veloxquant_mlx.llama_model import Model, own_model, owns
from veloxquant_mlx.memory.request_blocks import make_batch_caches

OWNED_FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "mistral_layer_types"]
PROMPT = [5, 17, 301, 9, 44, 2048, 7, 7, 63, 120, 3, 999] * 3  # 36 tokens: past the window


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: build_family_model(name, root / name)
            for name in [*OWNED_FAMILIES, "gemma2", "phi3"]}


def _greedy(model, caches, steps: int = 5) -> list[np.ndarray]:
    """The prompt's last logits, then each greedy step's."""
    logits = model(mx.array([PROMPT]), cache=caches)[:, -1, :]
    out = [np.array(logits)]
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)[:, None]
        logits = model(token, cache=caches)[:, -1, :]
        out.append(np.array(logits))
    return out


@pytest.mark.parametrize("family", OWNED_FAMILIES)
def test_logits_are_mlx_lms_bit_for_bit(family_folders, family):
    stock = mlx_lm.load(str(family_folders[family]))[0]
    owned = own_model(stock)
    assert isinstance(owned, Model) and owned is not stock
    want = _greedy(stock, make_prompt_cache(stock))
    got = _greedy(owned, make_prompt_cache(owned))
    for a, b in zip(want, got, strict=True):
        assert np.array_equal(a, b)
    # Same caches as mlx-lm asks for (a rotating one per sliding layer).
    assert ([type(c) for c in make_prompt_cache(owned)]
            == [type(c) for c in make_prompt_cache(stock)])


@pytest.mark.parametrize("family", OWNED_FAMILIES)
def test_the_parameter_tree_is_mlx_lms_over_the_same_arrays(family_folders, family):
    stock = mlx_lm.load(str(family_folders[family]))[0]
    owned = own_model(stock)
    want, got = tree_flatten(stock.parameters()), tree_flatten(owned.parameters())
    assert [name for name, _ in got] == [name for name, _ in want]
    assert all(a is b for (_, a), (_, b) in zip(want, got, strict=True))  # nothing copied


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_other_families_stay_mlx_lms(family_folders, family):
    stock = mlx_lm.load(str(family_folders[family]))[0]
    assert not owns(stock) and own_model(stock) is stock


def test_nothing_in_mlx_lm_is_modified(family_folders):
    """Owning, compiling and a paged batch's decode leave mlx-lm's modules as they were."""
    import mlx_lm.models.llama as llama

    before = (llama.scaled_dot_product_attention, llama.swiglu, llama.TransformerBlock.__call__)
    stock = mlx_lm.load(str(family_folders["llama"]))[0]
    owned = own_model(stock)
    assert compile_decode_blocks(owned) == len(owned.layers)
    arena = _arena(owned, n_blocks=256)
    batch, steps = _paged(owned, arena, [PROMPT[:20], PROMPT[:9]], 3, fast=True)
    assert batch.fast_attention and len(steps[0]) == 3
    batch.release()
    assert arena.pool.stats.blocks_in_use() == 0
    assert (llama.scaled_dot_product_attention, llama.swiglu,
            llama.TransformerBlock.__call__) == before
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert llama.swiglu is activations.swiglu
    assert all(type(b) is llama.TransformerBlock for b in stock.layers)  # no class swapped


def test_a_paged_batch_offers_its_parts_only_to_the_owned_model(family_folders):
    stock = mlx_lm.load(str(family_folders["llama"]))[0]
    owned = own_model(stock)
    assert owned.reads_paged_parts and not getattr(stock, "reads_paged_parts", False)


def _head(model):
    return model.lm_head if "lm_head" in model else model.model.embed_tokens.as_linear


def _after_last_column(model, caches, last_column: bool, steps: int = 3) -> list[np.ndarray]:
    """The prompt's last logits (the last block on the last column alone, or on every
    column), then greedy steps' over the KV that call stored."""
    hidden = model.model(mx.array([PROMPT]), caches, last_column=last_column)
    logits = _head(model)(hidden[:, -1:])[:, -1, :]
    out = [np.array(logits)]
    for _ in range(steps):
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=caches)[:, -1, :]
        out.append(np.array(logits))
    return out


@pytest.mark.parametrize("family", OWNED_FAMILIES)
def test_the_last_block_on_the_last_column_alone_gives_the_same_logits_and_kv(
        family_folders, family, monkeypatch):
    owned = own_model(mlx_lm.load(str(family_folders[family]))[0])
    every = _after_last_column(owned, make_prompt_cache(owned), False)
    alone = _after_last_column(owned, make_prompt_cache(owned), True)
    for a, b in zip(every, alone, strict=True):  # the steps after read the stored KV
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=0)
        assert np.argmax(a) == np.argmax(b)
    shapes = []
    original = type(owned.layers[-1].mlp).__call__
    monkeypatch.setattr(type(owned.layers[-1].mlp), "__call__",
                        lambda self, x: shapes.append(x.shape) or original(self, x))
    owned.model(mx.array([PROMPT]), make_prompt_cache(owned), last_column=True)
    assert shapes[-1] == (1, 1, owned.args.hidden_size)  # the last block's MLP: one column


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_last_column_alone_on_a_paged_batch(family_folders, fast, rows):
    """A chunk before the last one is stored; three rows are left-padded, one is not."""
    owned = own_model(mlx_lm.load(str(family_folders["llama"]))[0])
    prompts = [PROMPT, PROMPT[5:], PROMPT[11:30]][:rows]
    width = max(map(len, prompts))
    padded = mx.array([[0] * (width - len(p)) + p for p in prompts])
    got = []
    for last_column in (False, True):
        arena = _arena(owned)
        batch = make_batch_caches(owned, arena, list(range(1, rows + 1)),
                                  [width - len(p) for p in prompts], fast_attention=fast)
        owned(padded[:, :20], cache=batch.caches)  # the first chunk, stored
        hidden = owned.model(padded[:, 20:], batch.caches, last_column=last_column)
        got.append(np.array(_head(owned)(hidden[:, -1:])[:, -1, :]))
        batch.close()
        assert arena.pool.stats.blocks_in_use() == 0
    np.testing.assert_allclose(got[1], got[0], atol=2e-5, rtol=0)
    for i, prompt in enumerate(prompts):
        want = owned(mx.array([prompt]), cache=make_prompt_cache(owned))[:, -1, :]
        np.testing.assert_allclose(got[1][i], np.array(want)[0], atol=2e-4, rtol=0)
