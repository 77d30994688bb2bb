"""Log-probabilities of a prompt's own tokens (completions ``echo`` with ``logprobs``).

lm-evaluation-harness scores a continuation by sending prompt + continuation
with ``echo: true, max_tokens: 0, logprobs: N``: the answer is each prompt
token's log-probability given the tokens before it. Generation never computes
those (prefill samples only the next token), so scoring is a request of its
own kind, and a request like any other::

    route     GenerationRequest(score=N, max_tokens=0) -> Engine.submit
    preparer  tokenize, prompt limits (worker thread)
    scheduler queue bound, admission against the pool (KV blocks under its owner)
    runner    a prefill group of its own: each chunk runs the model over the pool's
              blocks and keeps every position's log-softmax as numbers
              (PromptScores.step), within the step's prefill budget and time
              slice; cancelled between chunks like any prefill
    end       Finished(result=PromptScores) -> route: records built on a worker
              thread, so no token text is decoded on the engine thread

Chunks of ``batch.prefill_chunk_size`` positions bound the logits held at
once (chunk x vocabulary floats).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.engine.intake import RequestRejected, tokenize_prompt
from server.engine.output import finite_logprob
from server.engine.protocol import Reason, Rejected
from server.model_loader import LoadedModel


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
        return Rejected(Reason.EMPTY_PROMPT, "the prompt is empty (0 tokens)", "prompt")
    if len(ids) > max_prompt_tokens:
        return Rejected(Reason.TOO_LARGE, f"prompt has {len(ids)} tokens, more than "
                        f"limits.max_prompt_tokens={max_prompt_tokens}; shorten the prompt",
                        "prompt")
    context = loaded.context_length
    if context is not None and len(ids) > context:  # positions the model never learned
        return Rejected(Reason.TOO_LARGE, f"prompt has {len(ids)} tokens, more than "
                        f"{loaded.context_phrase()}; shorten the prompt", "prompt")
    return ids
