"""Whole-prompt tasks: embeddings, and scores of a prompt's own tokens (further down).

Embeddings of a prompt: its final hidden states, pooled and normalized
(``/v1/embeddings``).

An embedding is a request like a generation: queued, admitted against the
pool, its KV in pool blocks under its own owner (a prompt longer than one chunk
attends to its earlier chunks there), prefilled alone in chunks within each
step's prefill budget, cancelled between chunks, its blocks back at the end::

    route     GenerationRequest(embed="mean", max_tokens=0) per input -> submit
    runner    each chunk: the model's backbone (``model.model``: the layers and the
              final norm, no vocabulary projection) -> (chunk, hidden) states,
              summed (mean) or the last kept (last)          PromptEmbedding.step
    end       Finished(result=PromptEmbedding) -> route: vector(), base64 or floats

Pooling follows sentence-transformers' conventions: the mean over every prompt
position, or the last position's state (what decoder embedding models such as
e5-mistral and Qwen3-Embedding read), then scaled to unit length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.engine.sampling import finite_logprob
from server.model_loader import LoadedModel
from server.refusal import Rejected, Why
from server.text.prompts import (
    RequestRejected,
    tokenize_prompt,
)

POOLINGS = ("mean", "last")


def can_embed(model: Any) -> bool:
    """Whether ``model`` exposes its backbone (``model.model``), whose output is the final
    hidden states: mlx-lm's decoder families (llama, qwen, mistral, gemma, phi3...)."""
    return callable(getattr(model, "model", None))


@dataclass(slots=True)
class PromptEmbedding:
    """One prompt's pooled hidden states, filled chunk by chunk on the engine thread.

    Attributes:
        ids: The prompt's token ids.
        pooling: ``"mean"`` or ``"last"``.
        fed: Prompt tokens run through the model so far.
        pooled: The running sum (mean) or the last state (last), float32; None before
            the first chunk.
        vector: The embedding once every token is in (unit length, Python floats:
            the route reads it off the engine thread, where no MLX work may run).
    """

    ids: list[int]
    pooling: str = "mean"
    fed: int = 0
    pooled: Any = None
    vector: list[float] | None = None

    @property
    def done(self) -> bool:
        """Every prompt token went through the model."""
        return self.fed >= len(self.ids)

    def step(self, model: Any, cache: list, positions: int) -> int:
        """Run the next ``positions`` prompt tokens through ``model``'s backbone.

        Returns:
            Tokens fed (0 when done).
        """
        import mlx.core as mx

        start, end = self.fed, min(self.fed + positions, len(self.ids))
        if end <= start:
            return 0
        hidden = model.model(mx.array(self.ids[start:end])[None], cache)[0]
        hidden = hidden.astype(mx.float32)
        if self.pooling == "last":
            part = hidden[-1]
        else:
            part = hidden.sum(axis=0)
            part = part if self.pooled is None else self.pooled + part
        self.pooled = part
        mx.eval(self.pooled)
        self.fed = end
        if self.done:
            self.vector = _unit(self.pooled / len(self.ids) if self.pooling == "mean"
                                else self.pooled)
        return end - start


def _unit(pooled: Any) -> list[float]:
    import mlx.core as mx

    norm = mx.sqrt(mx.sum(pooled * pooled))
    return (pooled / mx.maximum(norm, 1e-12)).tolist()



# Log-probabilities of a prompt's own tokens (completions ``echo`` with ``logprobs``).
#
# lm-evaluation-harness scores a continuation by sending prompt + continuation
# with ``echo: true, max_tokens: 0, logprobs: N``: the answer is each prompt
# token's log-probability given the tokens before it. Generation never computes
# those (prefill samples only the next token), so scoring is a request of its
# own kind, and a request like any other::
#
#     route     GenerationRequest(score=N, max_tokens=0) -> Engine.submit
#     preparer  tokenize, prompt limits (worker thread)
#     scheduler queue bound, admission against the pool (KV blocks under its owner)
#     runner    a prefill group of its own: each chunk runs the model over the pool's
#               blocks and keeps every position's log-softmax as numbers
#               (PromptScores.step), within the step's prefill budget and time
#               slice; cancelled between chunks like any prefill
#     end       Finished(result=PromptScores) -> route: records built on a worker
#               thread, so no token text is decoded on the engine thread
#
# Chunks of ``batch.prefill_chunk_size`` positions bound the logits held at
# once (chunk x vocabulary floats).


@dataclass(slots=True)
class PromptScores:
    """The numbers of one scored prompt, filled chunk by chunk on the engine thread.

    Attributes:
        ids: The prompt's token ids.
        top_n: Alternatives kept per position (0: the prompt's own token only).
        chosen: Log-probability of ``ids[j + 1]`` given ``ids[:j + 1]`` (finite: JSON
            has no -inf).
        top_ids: Per position, the ``top_n`` most likely ids.
        top_vals: Their log-probabilities (finite).
    """

    ids: list[int]
    top_n: int
    chosen: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_vals: list[list[float]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """Every position with a context is scored (the first token has none)."""
        return len(self.chosen) >= len(self.ids) - 1

    def step(self, model: Any, cache: list, positions: int) -> int:
        """Run the next ``positions`` prompt tokens through ``model`` into ``cache``.

        Returns:
            Tokens fed (0 when done).
        """
        import mlx.core as mx

        start = len(self.chosen)
        end = min(start + positions, len(self.ids) - 1)
        if end <= start:
            return 0
        logits = model(mx.array(self.ids[start:end])[None], cache=cache)[0]
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = mx.array(self.ids[start + 1:end + 1])
        chosen = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        if self.top_n:
            top_ids = mx.argpartition(-logprobs, kth=self.top_n - 1, axis=-1)[:, :self.top_n]
            top_vals = mx.take_along_axis(logprobs, top_ids, axis=-1)
            mx.eval(chosen, top_ids, top_vals)
            self.top_ids += top_ids.tolist()
            self.top_vals += [[finite_logprob(v) for v in row] for row in top_vals.tolist()]
        else:
            mx.eval(chosen)
        self.chosen += [finite_logprob(v) for v in chosen.tolist()]
        return end - start


def echo_ids(loaded: LoadedModel, max_prompt_tokens: int,
             prompt: str | list[int]) -> list[int] | Rejected:
    """The ids of a prompt echoed but scored by no model (``echo`` without ``logprobs``),
    or its refusal under the limits a generation's prompt meets. Blocks: a worker
    thread's."""
    try:
        ids = tokenize_prompt(loaded, prompt)
    except RequestRejected as exc:
        return exc.event
    if not ids:
        return Rejected(Why.EMPTY_PROMPT, param="prompt")
    if len(ids) > max_prompt_tokens:
        return Rejected(Why.PROMPT_OVER_LIMIT, {"tokens": len(ids), "limit": max_prompt_tokens},
                        "prompt")
    context = loaded.context_length
    if context is not None and len(ids) > context:  # positions the model never learned
        return Rejected(Why.PROMPT_OVER_CONTEXT, {"tokens": len(ids), **loaded.context_figures()},
                        "prompt")
    return ids
