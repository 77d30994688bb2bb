"""Per-request token samplers and logits processors (engine thread only: MLX graphs).

Filters (top-p, min-p, top-k) and the penalty / logit-bias processors are
mlx-lm's (``mlx_lm.sample_utils``). The draw itself is ours: mlx-lm's
``make_sampler`` draws from MLX's one global PRNG state, so a seeded request
could not own its key, and its draws would depend on which other requests
share the batch. Here a request with a ``seed`` carries its own key.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
)

from server.engine.protocol import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def build_sampler(params: SamplingParams) -> Sampler:
    """Build the token sampler of one request (argmax when temperature is 0).

    Args:
        params: The request's resolved sampling settings.

    Returns:
        A function from log-probabilities ``(1, vocab)`` to a token ``(1,)``.
    """
    if params.temperature == 0.0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0.0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p, 1))
    if params.top_k > 0:
        # top_k at or past the vocabulary keeps every token: a no-op, not an
        # error (mlx-lm's apply_top_k raises there).
        filters.append(lambda x: apply_top_k(x, params.top_k)
                       if params.top_k < x.shape[-1] else x)
    inv_temp = 1.0 / params.temperature
    # A seeded request owns its key: interleaving with others must not change its draws.
    key = [mx.random.key(params.seed)] if params.seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        for keep in filters:
            logprobs = keep(logprobs)
        if key is None:
            return mx.random.categorical(logprobs * inv_temp)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


def reset_random_state() -> None:
    """Give MLX's global PRNG a fresh state after a failed step.

    mlx-lm's samplers are ``mx.compile``d with the global random state as an
    input and output; one that raises mid-trace leaves that state as an array
    with no primitive, and every later unseeded draw in the process fails
    ("eval an array without a primitive"). Reseeding restores it; unseeded
    requests promise no particular stream, and seeded ones carry their own key.
    """
    mx.random.seed(secrets.randbits(63))


def build_logits_processors(params: SamplingParams) -> list[Callable]:
    """mlx-lm logits processors for penalties and logit bias (empty when unused)."""
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )
