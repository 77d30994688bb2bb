"""Log-probabilities of a prompt's own tokens (completions ``echo`` with ``logprobs``).

lm-evaluation-harness scores a continuation by sending prompt + continuation
with ``echo: true, max_tokens: 0, logprobs: N``: the answer is each prompt
token's log-probability given the tokens before it. Generation never computes
those (prefill samples only the next token), so scoring is a model pass of
its own, driven by the route one chunk at a time::

    worker thread  new_job(): tokenize, prompt limits        -> ScoringJob | Rejected
    engine thread  job.step() per Engine.run_on_engine call:
                   model(ids[a:b], cache) -> log-softmax (chunk, vocab)
                   -> logprob of ids[a+1 : b+1] and the top_n alternatives -> records

Chunks of ``batch.prefill_chunk_size`` tokens bound the logits held at once
(chunk x vocab floats), and running requests decode between two chunks. The
prompt's keys and values sit in a throwaway mlx-lm cache for the job's
duration only: working memory like prefill activations, bounded by
``limits.max_prompt_tokens`` and dropped with the job, never pool blocks
(a scoring job owns no blocks, so it cannot leak any).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.engine.intake import RequestRejected, tokenize_prompt
from server.engine.output import finite_logprob
from server.engine.protocol import Reason, Rejected, TokenLogprob, TopLogprob
from server.model_loader import LoadedModel


@dataclass(slots=True)
class ScoringJob:
    """One prompt being scored; :meth:`step` runs on the engine thread only.

    Attributes:
        ids: The prompt's token ids.
        tokens: Each token's text (``decode([id])``, as generated tokens report it).
        text: The prompt as echoed: the string sent, or the ids decoded.
        top_n: Alternatives per position; None when no log-probabilities are wanted.
        logprobs: Records of ``ids[1:]`` (the first token has no context to score it).
        done: Every position is scored (at once when ``top_n`` is None).
    """

    model: Any
    decode: Any
    chunk: int
    ids: list[int]
    tokens: list[str]
    text: str
    top_n: int | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    done: bool = False
    _cache: Any = None

    def __post_init__(self) -> None:
        self.done = self.top_n is None or len(self.ids) < 2

    def step(self) -> None:
        """Score the next chunk of positions (engine thread: MLX work)."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        if self.done:
            return
        if self._cache is None:
            self._cache = make_prompt_cache(self.model)
        start = len(self.logprobs)
        end = min(start + self.chunk, len(self.ids) - 1)
        logits = self.model(mx.array(self.ids[start:end])[None], cache=self._cache)[0]
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = mx.array(self.ids[start + 1:end + 1])
        chosen = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        top_ids = top_vals = None
        if self.top_n:
            top_ids = mx.argpartition(-logprobs, kth=self.top_n - 1, axis=-1)[:, :self.top_n]
            top_vals = mx.take_along_axis(logprobs, top_ids, axis=-1)
            mx.eval(chosen, top_ids, top_vals)
        else:
            mx.eval(chosen)
        self._records(start, chosen.tolist(), top_ids, top_vals)
        if end >= len(self.ids) - 1:
            self.done = True
            self._cache = None  # the prompt's KV goes as soon as the job is done

    def _records(self, start: int, chosen: list[float], top_ids: Any, top_vals: Any) -> None:
        ids_rows = top_ids.tolist() if top_ids is not None else [[]] * len(chosen)
        val_rows = top_vals.tolist() if top_vals is not None else [[]] * len(chosen)
        for j, value in enumerate(chosen):
            pairs = sorted(zip(ids_rows[j], val_rows[j], strict=True), key=lambda p: -p[1])
            top = tuple(TopLogprob(self.decode([i]), finite_logprob(v), int(i))
                        for i, v in pairs)
            token_id = self.ids[start + 1 + j]
            self.logprobs.append(TokenLogprob(self.tokens[start + 1 + j],
                                              finite_logprob(value), token_id, top))


def new_job(loaded: LoadedModel, max_prompt_tokens: int, chunk: int,
            prompt: str | list[int], top_n: int | None) -> ScoringJob | Rejected:
    """Tokenize and check ``prompt`` as a generation request's prompt (blocking; no MLX).

    Args:
        loaded: The loaded model.
        max_prompt_tokens: ``limits.max_prompt_tokens``.
        chunk: Positions scored per :meth:`ScoringJob.step`.
        prompt: Text or token ids.
        top_n: Alternatives per position, or None for no log-probabilities.

    Returns:
        The job, or the refusal the client gets (empty, too long, bad ids).
    """
    try:
        ids = tokenize_prompt(loaded, prompt)
    except RequestRejected as exc:
        return exc.event
    if not ids:
        return Rejected(Reason.EMPTY_PROMPT, "the prompt is empty (0 tokens)", "prompt")
    if len(ids) > max_prompt_tokens:
        return Rejected(Reason.TOO_LARGE, f"prompt has {len(ids)} tokens, more than "
                        f"limits.max_prompt_tokens={max_prompt_tokens}; shorten the prompt",
                        "prompt")
    context = loaded.context_length
    if context is not None and len(ids) > context:  # positions the model never learned
        return Rejected(Reason.TOO_LARGE, f"prompt has {len(ids)} tokens, more than "
                        f"{loaded.context_phrase()}; shorten the prompt", "prompt")
    decode = loaded.tokenizer.decode
    text = prompt if isinstance(prompt, str) else decode(ids)
    return ScoringJob(loaded.model, decode, chunk, ids, [decode([i]) for i in ids], text, top_n)
