"""Per-request sampling, logits processing, stop strings and log-probabilities.

Runs on the engine thread only (it builds MLX graphs). Each request gets its
own sampler closure; a request with a ``seed`` carries its own PRNG key, so
its draws do not depend on which other requests share the engine.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
)

from server.generation import SamplingParams, TokenLogprob, TopLogprob

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
        # error (mlx-lm's apply_top_k raises there; fuzzing made that a 500).
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


def token_logprob(
    logprobs: mx.array, token_id: int, top_n: int, decode: Callable[[list[int]], str]
) -> TokenLogprob:
    """Log-probability of the chosen token and the ``top_n`` best alternatives.

    Args:
        logprobs: Normalized log-probabilities over the vocabulary ``(vocab,)``.
        token_id: The sampled token.
        top_n: How many alternatives to report (0 for none).
        decode: Token ids to text.
    """
    chosen = logprobs[token_id].item()
    top: tuple[TopLogprob, ...] = ()
    if top_n > 0:
        ids = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
        values = logprobs[ids]
        pairs = sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda p: -p[1])
        top = tuple(TopLogprob(decode([i]), _finite(v), int(i)) for i, v in pairs)
    return TokenLogprob(decode([token_id]), _finite(chosen), token_id, top)


def _finite(value: float) -> float:
    """JSON has no inf/NaN: an impossible token reports -9999.0, as OpenAI's API does."""
    return float(value) if math.isfinite(value) else -9999.0


class StopMatcher:
    """Finds stop strings in streamed text, across token boundaries.

    Text is fed piece by piece; ``feed`` returns what is safe to emit now and
    whether a stop string was hit. Text that could still be the start of a
    stop string is held back until it either completes one (then it is dropped
    with everything after it) or cannot any more (then it is released)::

        stop = "END"   fed: "the E" -> emit "the ", hold "E"
                       fed: "N"     -> emit "",     hold "EN"
                       fed: "D!"    -> stop; output so far "the " (stop excluded)
    """

    __slots__ = ("_stops", "_hold", "_pending")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        # Longest proper prefix of a stop string that may be pending at the end of the text.
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, stop string hit)."""
        if not self._stops:
            return text, False
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._pending = ""
            return buf[:cut], True
        keep = self._partial_suffix(buf)
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release held-back text at the end of generation (no stop string completed)."""
        out, self._pending = self._pending, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for n in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
