"""A prompt's last call projects only its last column onto the vocabulary.

server/engine/prefill.py: for mlx-lm's Llama/Qwen models the backbone runs
on every column and the head on the last one; the first tokens are those of
the whole projection (logits within float rounding), and a large group no
longer spends an extra model call to get there. Other models keep the whole
projection.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from server.engine.prefill import last_column_logits, projects_last_column
from server.engine.run_output import StepClock
from server.engine.runner import ModelRunner
from server.protocol import SamplingParams
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout


@pytest.fixture(scope="module")
def model(tiny_model_path):
    import mlx_lm

    return mlx_lm.load(str(tiny_model_path))[0]


class _Wrapped:
    """A model whose class is not mlx-lm's: its head cannot be split off."""

    def __init__(self, inner):
        self.inner, self.layers = inner, inner.layers

    def __call__(self, x, cache=None):
        return self.inner(x, cache=cache)


def _prompts(rows: int, n: int) -> list[list[int]]:
    return [[5 + (r * 13 + 7 * j) % 240 for j in range(n)] for r in range(rows)]


def test_the_head_sees_one_column_and_gives_the_full_projections_logits(model, monkeypatch):
    assert projects_last_column(model) and not projects_last_column(_Wrapped(model))
    x = mx.array(_prompts(3, 40))
    want = model(x, cache=make_prompt_cache(model))[:, -1, :]
    seen = []
    head = model.model.embed_tokens.as_linear  # the tiny model ties its embeddings

    def recorded(h):
        seen.append(h.shape)
        return head(h)

    monkeypatch.setattr(model.model.embed_tokens, "as_linear", recorded)
    got = last_column_logits(model, x, make_prompt_cache(model))
    assert seen == [(3, 1, model.args.hidden_size)]
    assert mx.abs(got - want).max().item() < 1e-5
    assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1))
    wrapped = last_column_logits(_Wrapped(model), x, make_prompt_cache(model))
    assert seen[1] == (3, 40, model.args.hidden_size)  # every column projected
    assert mx.array_equal(wrapped, want)


def _first_tokens(model, prompts) -> tuple[dict[int, int], int]:
    """First tokens the runner samples (greedy), and the backbone calls prefill made."""
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=1024))
    runner = ModelRunner(model, pool, 512, KVArena(pool, probe_kv_layout(model)), StepClock())
    for owner, prompt in enumerate(prompts, start=1):
        runner.add(owner, prompt, SamplingParams(max_tokens=4, temperature=0.0))
    calls = []
    backbone = type(model.model).__call__

    def counted(self, *args, **kwargs):
        calls.append(args[0].shape)
        return backbone(self, *args, **kwargs)

    type(model.model).__call__ = counted
    first = {}
    try:
        while runner.prompts_pending:  # nothing decodes: the prefill hands them back
            first.update((s.owner, s.token) for s in runner.prefill(1 << 20).tokens)
    finally:
        type(model.model).__call__ = backbone
    runner.remove(range(1, len(prompts) + 1))
    assert pool.stats.blocks_in_use() == 0
    return first, len(calls)


def test_a_large_group_takes_its_prompt_in_one_call_with_the_same_first_tokens(model):
    prompts = _prompts(8, 40)  # 8 x 39 positions: one call, the last column not split off
    first, calls = _first_tokens(model, prompts)
    assert calls == 1
    for owner, prompt in enumerate(prompts, start=1):
        logits = model(mx.array([prompt]), cache=make_prompt_cache(model))[:, -1, :]
        assert first[owner] == mx.argmax(logits, -1).item()
