"""The benchmarks' harness (server.harness): the server's runner, driven step by step."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from server.harness import RunnerHarness
from server.protocol import SamplingParams
from server.settings import load_settings

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def _prompts(n: int, length: int) -> dict[int, list[int]]:
    return {owner: [5 + (owner * 7 + j * 3) % 200 for j in range(length + owner)]
            for owner in range(1, n + 1)}


def _stock_greedy(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own cache, one token at a time: the reference."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    out = []
    for _ in range(n):
        token = mx.argmax(logits, -1).item()
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return out


def _run(harness: RunnerHarness, prompts: dict[int, list[int]], steps: int,
         budget: int = 1 << 20) -> dict[int, list[int]]:
    """``steps`` tokens a row, greedy (:meth:`RunnerHarness.generate`)."""
    got = harness.generate(prompts, GREEDY, steps, budget)
    return {owner: [s.token for s in sampled] for owner, sampled in got.items()}


def test_a_model_harness_generates_what_mlx_lm_does_and_gives_every_block_back(tiny_model):
    model, _ = tiny_model
    prompts = _prompts(3, 20)
    with RunnerHarness.for_model(model, n_blocks=256) as harness:
        got = _run(harness, prompts, 5)
        assert harness.pool.stats.blocks_in_use() > 0
        held = harness.finish(prompts)
        assert set(held) == set(prompts) and all(n > 0 for n in held.values())
        assert harness.pool.stats.blocks_in_use() == 0
        assert harness.finish(prompts) == {owner: 0 for owner in prompts}  # twice: harmless
    for owner, prompt in prompts.items():
        assert got[owner] == _stock_greedy(model, prompt, 5)


def test_prefill_takes_every_prompt_in_whatever_the_budget(tiny_model):
    model, _ = tiny_model
    prompts = _prompts(2, 40)
    with RunnerHarness.for_model(model, n_blocks=256) as big:
        whole = _run(big, prompts, 3)
    with RunnerHarness.for_model(model, n_blocks=256) as small:
        chunked = _run(small, prompts, 3, budget=16)  # several calls, same tokens
    assert chunked == whole


def test_the_served_build_runs_the_same_tokens_and_closes_its_workers(tiny_model_path,
                                                                       tiny_model):
    settings = load_settings(None, overrides={"model": {"path": str(tiny_model_path)}},
                             env={})
    prompts = _prompts(2, 24)
    served = RunnerHarness.served(settings)
    try:
        assert served.loaded is not None and served.loaded.context_length
        tokens = _run(served, prompts, 4)
        served.finish(prompts)
        assert served.pool.stats.blocks_in_use() == 0
    finally:
        served.close()
    model, _ = tiny_model
    with RunnerHarness.for_model(model, n_blocks=256) as plain:
        assert _run(plain, prompts, 4) == tokens


def test_settings_build_takes_write_back_and_compiled_decode_from_the_settings(
        tiny_model_path):
    settings = load_settings(None, overrides={
        "model": {"path": str(tiny_model_path)},
        "batch": {"kv_write_back": 4, "compile_decode": True}}, env={})
    with RunnerHarness.for_settings(settings, n_blocks=256) as harness:
        got = _run(harness, _prompts(2, 10), 6)
        assert harness.compiled_blocks > 0  # the tiny model is Llama-shaped
        assert all(len(tokens) == 6 for tokens in got.values())
        assert harness.clock.totals()[1]  # the runner timed its phases


@pytest.mark.parametrize("steps", [1, 3])
def test_decode_before_any_prompt_is_a_step_without_rows(tiny_model, steps):
    model, _ = tiny_model
    with RunnerHarness.for_model(model, n_blocks=64) as harness:
        for _ in range(steps):
            out = harness.decode()
            assert out.tokens == [] and out.rows == 0


def test_generate_says_so_when_a_row_fails(tiny_model):
    """A prompt the pool cannot hold fails its row: generate raises, nothing is held."""
    model, _ = tiny_model
    with RunnerHarness.for_model(model, n_blocks=8) as harness:
        with pytest.raises(RuntimeError, match="the runner failed"):
            harness.generate({1: _prompts(1, 200)[1]}, GREEDY, 3)
        assert harness.pool.stats.blocks_in_use() == 0
