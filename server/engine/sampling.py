"""Token sampling: per-request samplers and processors, and a decode batch's plan.

Engine thread only (MLX graphs). The batch plan (:class:`SamplingPlan`) is at
the end.


Filters (top-p, min-p, top-k) and the penalty / logit-bias processors are
mlx-lm's (``mlx_lm.sample_utils``). The draw itself is ours: mlx-lm's
``make_sampler`` draws from MLX's one global PRNG state, so a seeded request
could not own its key, and its draws would depend on which other requests
share the batch. Here a request with a ``seed`` carries its own key.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
)

from server.protocol import SamplingParams, TokenLogprob, TopLogprob
from server.text.grammar import BatchMasks
from server.text.token_bytes import TokenBytes

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


def build_logits_processors(params: SamplingParams, prompt_tokens: int = 0) -> list[Callable]:
    """Logits processors for penalties and logit bias (empty when unused).

    ``logit_bias`` and ``repetition_penalty`` are mlx-lm's (the latter over the
    last 20 tokens, prompt included, as mlx-lm and its server apply it).
    ``presence_penalty`` and ``frequency_penalty`` are OpenAI's: over every token
    generated so far and none of the prompt's ``prompt_tokens`` (mlx-lm's count
    the prompt and only the last 20 tokens, so a greedy ``frequency_penalty: -2``
    repeated a prompt word as its first token).
    """
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty,
    )
    if params.presence_penalty or params.frequency_penalty:
        processors.append(_output_penalty(params.presence_penalty or 0.0,
                                          params.frequency_penalty or 0.0, prompt_tokens))
    return processors


def _output_penalty(presence: float, frequency: float, prompt_tokens: int) -> Callable:
    """OpenAI's penalties: ``logit - frequency * count - presence * (count > 0)``.

    ``count`` is how often a token was generated; it is kept per request and
    grows by the tokens the history gained since the last call (one a step).
    """
    counts: mx.array | None = None
    seen = prompt_tokens

    def penalise(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal counts, seen
        if counts is None:
            counts = mx.zeros((logits.shape[-1],), dtype=mx.float32)
        if tokens.size > seen:
            counts = counts.at[tokens[seen:]].add(1.0)
            seen = tokens.size
        return logits - (frequency * counts + presence * (counts > 0)).astype(logits.dtype)

    return penalise


def batchable(params: SamplingParams) -> bool:
    """Whether a request can share the batch-wide sampler.

    Unseeded requests without penalties or logit bias draw from the global
    PRNG with per-row temperature and filters, so a whole batch of them samples
    in a few array ops. A seeded request owns its key and a request with
    processors needs its own history: those sample row by row.
    """
    return params.seed is None and not build_logits_processors(params)


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """Per-row sampling settings of a decode batch, as ``(rows,)`` arrays.

    Neutral values switch a filter off for a row: top_p 1, top_k 0, min_p 0;
    temperature 0 is greedy.
    """

    temperature: mx.array
    top_p: mx.array
    top_k: mx.array
    min_p: mx.array
    filters: tuple[bool, bool, bool]  # some row uses top-p / min-p / top-k

    @classmethod
    def of(cls, params: list[SamplingParams]) -> BatchSettings:
        """The settings of ``params``, one per row."""
        top_p = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
        # Past the vocabulary top_k keeps every token, so capping it there (and within
        # int32) changes nothing; an uncapped 2**31 failed the whole batch's step.
        top_k = [min(max(p.top_k, 0), _TOP_K_CAP) for p in params]
        min_p = [max(p.min_p, 0.0) for p in params]
        return cls(mx.array([p.temperature for p in params], dtype=mx.float32),
                   mx.array(top_p, dtype=mx.float32), mx.array(top_k, dtype=mx.int32),
                   mx.array(min_p, dtype=mx.float32),
                   (min(top_p) < 1.0, max(min_p) > 0.0, max(top_k) > 0))


_TOP_K_CAP = 2**31 - 1


def _keep_top_p(logprobs: mx.array, top_p: mx.array) -> mx.array:
    """Per row, the likeliest tokens until their mass reaches ``top_p`` (mlx-lm's rule).

    Sorted ascending, a token is dropped when the mass of the tokens above it
    already reaches ``top_p``; the rest are kept, ties at the cut included.
    """
    ranked = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ranked.astype(mx.float32))
    above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = above[:, :1] + probs[:, :1]
    dropped = (above >= top_p[:, None] * total).sum(axis=-1, keepdims=True)
    cut = mx.take_along_axis(ranked, dropped, axis=-1)
    return mx.where(logprobs >= cut, logprobs, -mx.inf)


def _keep_min_p(logprobs: mx.array, min_p: mx.array) -> mx.array:
    """Per row, tokens at least ``min_p`` times as likely as the likeliest one."""
    floor = mx.max(logprobs, axis=-1, keepdims=True) + mx.log(min_p)[:, None]
    return mx.where(logprobs >= floor, logprobs, -mx.inf)


def _keep_top_k(logprobs: mx.array, top_k: mx.array) -> mx.array:
    """Per row, the ``top_k`` likeliest tokens (0, or k past the vocabulary: all)."""
    vocab = logprobs.shape[-1]
    ranked = mx.sort(logprobs, axis=-1)  # ascending: the k-th largest sits at vocab - k
    at = mx.clip(vocab - top_k, 0, vocab - 1)[:, None]
    kth = mx.take_along_axis(ranked, at, axis=-1)
    kth = mx.where((top_k > 0)[:, None] & (top_k < vocab)[:, None], kth, -mx.inf)
    return mx.where(logprobs >= kth, logprobs, -mx.inf)


def _sample_batch(logprobs: mx.array, temperature: mx.array, top_p: mx.array,
                  top_k: mx.array, min_p: mx.array, filters: tuple[bool, bool, bool]) -> mx.array:
    """One token per row: argmax where temperature is 0, else a filtered, tempered draw.

    The filters run in the order a single request's sampler applies them
    (top-p, min-p, top-k), each only when some row of the batch uses it.
    """
    use_top_p, use_min_p, use_top_k = filters
    kept = logprobs
    if use_top_p:
        kept = _keep_top_p(kept, top_p)
    if use_min_p:
        kept = _keep_min_p(kept, min_p)
    if use_top_k:
        kept = _keep_top_k(kept, top_k)
    greedy = temperature == 0.0
    inv_temp = 1.0 / mx.where(greedy, 1.0, temperature)
    drawn = mx.random.categorical(kept * inv_temp[:, None])
    return mx.where(greedy, mx.argmax(logprobs, axis=-1), drawn).astype(mx.uint32)


# One compiled sampler per filter combination (MLX retraces per batch shape).
# The global PRNG state is an input and an output, as in mlx-lm's samplers.
_COMPILED: dict[tuple[bool, bool, bool], Callable] = {}


def sample_batch(logprobs: mx.array, settings: BatchSettings) -> mx.array:
    """Tokens ``(rows,)`` for a batch of batchable rows, through a compiled graph.

    Compiling fuses the sampler's element-wise work into a few kernels and
    replays the traced graph instead of rebuilding it in Python every step.
    """
    fn = _COMPILED.get(settings.filters)
    if fn is None:
        filters = settings.filters
        fn = mx.compile(lambda lp, t, p, k, m: _sample_batch(lp, t, p, k, m, filters),
                        inputs=[mx.random.state], outputs=[mx.random.state])
        _COMPILED[filters] = fn
    return fn(logprobs, settings.temperature, settings.top_p, settings.top_k, settings.min_p)


def _mask_logits(logits: mx.array, words: mx.array, free: mx.array) -> mx.array:
    """``logits`` with every token a row's bit mask forbids set to -inf (free rows untouched).

    ``words`` is ``(rows, W)`` int32, bit ``j % 32`` of word ``j // 32`` standing
    for token ``j``; tokens past ``32 * W`` (a model vocabulary padded beyond
    the tokenizer's) are forbidden to constrained rows.
    """
    rows, vocab = logits.shape
    shifts = mx.arange(32, dtype=mx.int32)
    bits = ((words[:, :, None] >> shifts) & 1).reshape(rows, -1) != 0
    if bits.shape[1] >= vocab:
        bits = bits[:, :vocab]
    else:
        bits = mx.concatenate([bits, mx.zeros((rows, vocab - bits.shape[1]), dtype=mx.bool_)],
                              axis=1)
    return mx.where(bits | free[:, None], logits, -mx.inf)


# Fused unpack-and-select (one kernel chain instead of five ops; retraced per shape).
_MASK = mx.compile(_mask_logits)


def mask_logits(logits: mx.array, words: mx.array, free: mx.array) -> mx.array:
    """Apply grammar masks: ``(rows, vocab)`` logits, ``(rows, W)`` int32 bit masks,
    ``(rows,)`` bool rows left free. See :func:`_mask_logits`."""
    return _MASK(logits, words, free)



# How the rows of a decode batch draw their next tokens.
#
# Each row samples with its own settings (temperature, top-p/k, min-p, seed,
# penalties, logit bias). A :class:`SamplingPlan` says, once per set of rows,
# how: every row greedy (one ``argmax``); or rows without a seed or processors
# together in one compiled graph with per-row settings
# (``sampling.sample_batch``), and the others one by one, written over the
# batch's. Rows with a grammar have their logits masked to what it allows
# first (:func:`constrain`).


@dataclass(frozen=True, slots=True)
class SamplingPlan:
    """The decode batch's sampling: all greedy, or batch settings plus rows sampled alone.

    ``masks`` (with ``free``, which rows have no grammar) when some row is constrained;
    ``logprobs``: some row hands back log-probabilities; ``banned``: (rows, tokens)
    index pairs never sampled (``ignore_eos``), when some row has them.
    """

    greedy: bool
    settings: BatchSettings | None
    own: list[int]
    masks: BatchMasks | None = None
    free: mx.array | None = None
    logprobs: bool = False
    banned: tuple[mx.array, mx.array] | None = None

    @classmethod
    def of(cls, rows: list[Any]) -> SamplingPlan:
        """The plan of ``rows`` (valid until rows join or leave)."""
        greedy = all(r.greedy for r in rows)
        settings = None if greedy else BatchSettings.of([r.params for r in rows])
        own = [i for i, r in enumerate(rows) if not r.shared]
        matchers = [r.matcher for r in rows]
        masks, free = None, None
        if any(m is not None for m in matchers):
            masks = BatchMasks(matchers)
            free = mx.array(masks.free)
        pairs = [(i, token) for i, r in enumerate(rows) if r.params is not None
                 for token in r.params.banned_tokens]
        banned = None
        if pairs:
            at_rows, tokens = zip(*pairs, strict=True)
            banned = (mx.array(at_rows, dtype=mx.int32), mx.array(tokens, dtype=mx.int32))
        return cls(greedy, settings, own, masks, free, any(r.want_logprobs for r in rows),
                   banned)


def ban(logits: mx.array, rows: mx.array, tokens: mx.array) -> mx.array:
    """``logits`` with each (row, token) pair at -inf: a token that row never samples."""
    return logits.at[rows, tokens].add(-mx.inf)


def sample_one(row: Any, logits: mx.array) -> tuple[mx.array, mx.array]:
    """One row's token from its ``(1, vocab)`` logits with its own sampler; and the log-probs."""
    for processor in row.processors:
        logits = processor(row.history, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return row.sampler(logprobs), logprobs


def sample_rows(plan: SamplingPlan, rows: list[Any], logits: mx.array,
                current: mx.array) -> tuple[mx.array, mx.array]:
    """Next token of every row, each with its own settings; and the log-probabilities.

    ``current``: each row's token fed this step (the processors' history grows by it).
    """
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if plan.greedy:  # the argmax of the logits: no log-softmax to wait for
        return mx.argmax(logits, axis=-1).astype(mx.uint32), logprobs
    tokens = sample_batch(logprobs, plan.settings)
    if plan.own:
        picks, own_lp = [], []
        for i in plan.own:
            row = rows[i]
            if row.processors:
                row.history = mx.concatenate([row.history, current[i: i + 1]])
            token, lp = sample_one(row, logits[i: i + 1])
            picks.append(token.astype(mx.uint32))
            own_lp.append(lp)
        at = mx.array(plan.own, dtype=mx.int32)
        tokens[at] = mx.concatenate(picks)
        logprobs[at] = mx.concatenate(own_lp)
    return tokens, logprobs


def constrain(plan: SamplingPlan, logits: mx.array,
              tokens: list[int]) -> tuple[mx.array, list[tuple[int, Exception]]]:
    """Advance the constrained rows' grammars past ``tokens``; mask their next token.

    Returns:
        The masked logits, and (row index, error) of each row whose grammar
        refused its token.
    """
    refused = list(plan.masks.step(tokens))
    return mask_logits(logits, mx.array(plan.masks.bitmask), plan.free), refused


def finite_logprob(value: float) -> float:
    """JSON has no inf/NaN: an impossible token reports -9999.0, as OpenAI's API does."""
    return float(value) if math.isfinite(value) else -9999.0


def token_logprob(
    logprobs: mx.array, token_id: int, top_n: int, token_bytes: TokenBytes,
) -> TokenLogprob:
    """Log-probability of the chosen token and the ``top_n`` best alternatives.

    Args:
        logprobs: Normalized log-probabilities over the vocabulary ``(vocab,)``.
        token_id: The sampled token.
        top_n: How many alternatives to report (0 for none).
        token_bytes: A token id's own bytes, and its text (:meth:`TokenBytes.text`).
    """
    chosen = logprobs[token_id].item()
    top: tuple[TopLogprob, ...] = ()
    if top_n > 0:
        ids = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
        values = logprobs[ids]
        pairs = sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda p: -p[1])
        top = tuple(TopLogprob(token_bytes.text(int(i)), finite_logprob(v), int(i),
                               token_bytes(int(i))) for i, v in pairs)
    return TokenLogprob(token_bytes.text(token_id), finite_logprob(chosen), token_id, top,
                        token_bytes(token_id))
