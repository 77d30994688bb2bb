"""The batch-wide sampler keeps what each request's own sampler would keep.

Each row of a decode batch may ask for its own temperature, top-p, min-p and
top-k; the batch sampler applies them all in one compiled graph. These tests
compare its filters row by row with mlx-lm's single-request filters, and its
draws with the distributions they should follow.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from server.engine.sampling import (
    BatchSettings,
    _keep_min_p,
    _keep_top_k,
    _keep_top_p,
    batchable,
    build_logits_processors,
    sample_batch,
)
from server.protocol import SamplingParams

VOCAB = 64


def _logprobs(rows: int, seed: int) -> mx.array:
    logits = mx.random.normal((rows, VOCAB), key=mx.random.key(seed)) * 3.0
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _kept(x: mx.array) -> np.ndarray:
    return np.isfinite(np.array(x))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filters_match_mlx_lm_row_by_row(seed):
    top_p = [0.1, 0.5, 0.9, 1.0]
    min_p = [0.0, 0.05, 0.2, 0.5]
    top_k = [0, 1, 5, VOCAB]
    lp = _logprobs(4, seed)
    got_p = _kept(_keep_top_p(lp, mx.array(top_p)))
    got_m = _kept(_keep_min_p(lp, mx.array(min_p)))
    got_k = _kept(_keep_top_k(lp, mx.array(top_k, dtype=mx.int32)))
    for i in range(4):
        row = lp[i: i + 1]
        want_p = _kept(apply_top_p(row, top_p[i]))[0] if top_p[i] < 1.0 else np.ones(VOCAB, bool)
        want_m = _kept(apply_min_p(row, min_p[i]))[0] if min_p[i] > 0 else np.ones(VOCAB, bool)
        want_k = (_kept(apply_top_k(row, top_k[i]))[0] if 0 < top_k[i] < VOCAB
                  else np.ones(VOCAB, bool))
        assert (got_p[i] == want_p).all(), f"top_p row {i}"
        assert (got_m[i] == want_m).all(), f"min_p row {i}"
        assert (got_k[i] == want_k).all(), f"top_k row {i}"


def test_greedy_and_top_k_1_rows_take_the_argmax_next_to_sampled_rows():
    lp = _logprobs(4, 7)
    params = [SamplingParams(max_tokens=1, temperature=0.0),
              SamplingParams(max_tokens=1, temperature=1.5, top_k=1),
              SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5),
              SamplingParams(max_tokens=1, temperature=0.7, min_p=0.1)]
    best = np.array(mx.argmax(lp, axis=-1))
    for _ in range(5):
        tokens = np.array(sample_batch(lp, BatchSettings.of(params)))
        assert tokens.dtype == np.uint32 and tokens.shape == (4,)
        assert tokens[0] == best[0] and tokens[1] == best[1]
        # Sampled rows only draw tokens their filters keep.
        assert _kept(_keep_top_p(lp, mx.array([1.0, 1.0, 0.5, 1.0])))[2][tokens[2]]
        assert _kept(_keep_min_p(lp, mx.array([0.0, 0.0, 0.0, 0.1])))[3][tokens[3]]


@pytest.mark.parametrize("top_k", [2**31, 2**63])
def test_a_top_k_past_int32_keeps_every_token_beside_other_rows(top_k):
    # Cast to int32 unchecked, it raises std::bad_cast and fails every row of the step.
    lp = _logprobs(2, 3)
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_k=top_k),
              SamplingParams(max_tokens=1, temperature=0.0)]
    settings = BatchSettings.of(params)
    assert _kept(_keep_top_k(lp, settings.top_k))[0].all()
    tokens = np.array(sample_batch(lp, settings))
    assert tokens[1] == np.array(mx.argmax(lp, axis=-1))[1]


def test_draws_follow_the_tempered_distribution():
    # Two tokens with probabilities 0.8 / 0.2; temperature 1 keeps them, 0.5 sharpens
    # them to 0.8^2 : 0.2^2 = 0.941 : 0.059.
    base = mx.array([[math.log(0.8), math.log(0.2)] + [-math.inf] * (VOCAB - 2)])
    n = 4000
    lp = mx.repeat(base, n, axis=0)
    params = [SamplingParams(max_tokens=1, temperature=1.0)] * (n // 2) + \
        [SamplingParams(max_tokens=1, temperature=0.5)] * (n // 2)
    mx.random.seed(3)
    tokens = np.array(sample_batch(lp, BatchSettings.of(params)))
    assert set(np.unique(tokens)) <= {0, 1}
    assert abs((tokens[: n // 2] == 0).mean() - 0.8) < 0.03
    assert abs((tokens[n // 2:] == 0).mean() - 0.941) < 0.02


def test_seeded_rows_and_rows_with_processors_sample_alone():
    assert batchable(SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9))
    assert not batchable(SamplingParams(max_tokens=1, temperature=1.0, seed=5))
    assert not batchable(SamplingParams(max_tokens=1, presence_penalty=0.5))
    assert not batchable(SamplingParams(max_tokens=1, logit_bias=((3, 5.0),)))


def test_presence_and_frequency_penalties_count_only_generated_tokens():
    """OpenAI's rule: every generated token so far, none of the prompt, no window."""
    params = SamplingParams(max_tokens=64, presence_penalty=0.5, frequency_penalty=1.0)
    (penalty,) = build_logits_processors(params, prompt_tokens=2)
    logits = mx.zeros((1, 10))
    prompt = [5, 6]
    assert (penalty(mx.array(prompt), logits) == 0).all()  # nothing generated yet
    generated = [7] + [9] * 30 + [7, 8]  # token 7 first seen 32 tokens ago
    history = prompt
    for token in generated:  # one call a step, as the runner makes them
        history = history + [token]
        out = penalty(mx.array(history), logits)
    expect = [0.0] * 10
    expect[7], expect[8], expect[9] = -(2 * 1.0 + 0.5), -(1.0 + 0.5), -(30 * 1.0 + 0.5)
    assert out[0].tolist() == expect


def test_a_negative_frequency_penalty_leaves_the_first_token_alone(live_server):
    """The prompt is not counted: greedy's first token is the unpenalised one."""
    import httpx

    body = {"prompt": "once upon a time there was a time", "max_tokens": 3, "temperature": 0}
    url = live_server.base_url + "/v1/completions"
    free = httpx.post(url, json={**body, "logprobs": 1}, timeout=60).json()
    boosted = httpx.post(url, json={**body, "logprobs": 1, "frequency_penalty": -2.0},
                         timeout=60).json()
    first = [r["choices"][0]["logprobs"]["tokens"][0] for r in (free, boosted)]
    assert first[0] == first[1]
