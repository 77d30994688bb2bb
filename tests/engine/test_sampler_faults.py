"""A sampler fault must not outlive its request.

mlx-lm's samplers are compiled with MLX's global PRNG state as an input and
output; one that raised mid-trace (top_k past the vocabulary did) left that
state broken, and every later unseeded request in the process failed.
"""

from __future__ import annotations

import httpx
import mlx.core as mx
import pytest
from mlx_lm.sample_utils import apply_top_k

from server.engine.sampling import reset_random_state
from tests.support.servers import LiveServer


def test_reset_random_state_repairs_a_poisoned_prng():
    logprobs = mx.log(mx.softmax(mx.random.normal((1, 50)), axis=-1))
    with pytest.raises(ValueError):
        apply_top_k(logprobs, 500)  # raises inside mlx-lm's compiled sampler
    with pytest.raises(RuntimeError, match="primitive"):
        mx.random.categorical(logprobs).item()  # the state is broken now
    reset_random_state()
    assert 0 <= mx.random.categorical(logprobs).item() < 50


def test_top_k_past_the_vocabulary_keeps_every_token_and_breaks_nothing(
        live_server: LiveServer):
    url = live_server.base_url + "/v1/completions"
    body = {"prompt": "The old city", "max_tokens": 4, "temperature": 0.8}
    huge = httpx.post(url, json={**body, "top_k": 10**9}, timeout=60)
    assert huge.status_code == 200, huge.text
    for _ in range(3):  # unseeded random sampling still works afterwards
        after = httpx.post(url, json=body, timeout=60)
        assert after.status_code == 200, after.text
        assert after.json()["usage"]["completion_tokens"] >= 1
