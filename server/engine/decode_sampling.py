"""How the rows of a decode batch draw their next tokens.

Each row samples with its own settings (temperature, top-p/k, min-p, seed,
penalties, logit bias). A :class:`SamplingPlan` says, once per set of rows,
how: every row greedy (one ``argmax``); or rows without a seed or processors
together in one compiled graph with per-row settings
(``sampling.sample_batch``), and the others one by one, written over the
batch's. Rows with a grammar have their logits masked to what it allows
first (:func:`constrain`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from server.engine.constraints import BatchMasks
from server.engine.prefill import Row
from server.engine.sampling import BatchSettings, mask_logits, sample_batch


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
    def of(cls, rows: list[Row]) -> SamplingPlan:
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


def sample_one(row: Row, logits: mx.array) -> tuple[mx.array, mx.array]:
    """One row's token from its ``(1, vocab)`` logits with its own sampler; and the log-probs."""
    for processor in row.processors:
        logits = processor(row.history, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return row.sampler(logprobs), logprobs


def sample_rows(plan: SamplingPlan, rows: list[Row], logits: mx.array,
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
