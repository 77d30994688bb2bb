"""``POST /v1/completions`` request model."""

from __future__ import annotations

from pydantic import Field

from server.http.schemas.common import STRICT_BODY, SamplingFields


class CompletionRequest(SamplingFields):
    """Legacy text completion: prompts (text or token ids) in, one choice per prompt and n.

    ``prompt`` is a string, a list of token ids, or a batch: a list of
    strings or a list of token-id lists (choice ``index`` = prompt index x n
    + i). Mixing strings and token lists is a 400.
    """

    model_config = STRICT_BODY

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="Prompt text or token ids, or a list of either (a batch).")
    # At least 1, or 0 with echo: true (score the prompt, generate nothing): checked by
    # the route with echo in view, so -1 and 0 get the same message.
    max_tokens: int | None = Field(default=None, description="Most tokens to generate.")
    logprobs: int | None = Field(default=None, ge=0, le=20,
                                 description="Return this many top log-probabilities.")
    echo: bool = Field(default=False, description="Prepend the prompt (and, with logprobs, "
                                                  "its tokens' log-probabilities).")
    best_of: int | None = Field(default=None, ge=1, description="Only null or equal to n.")
    suffix: str | None = None
