"""``POST /v1/completions`` request model."""

from __future__ import annotations

from pydantic import Field

from server.http.schemas.common import SamplingFields


class CompletionRequest(SamplingFields):
    """Legacy text completion: a prompt string (or token ids) in, text out.

    ``prompt`` may be a string, a list of token ids, or a one-element list
    of either (the API's batch form with a single prompt).
    """

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="Prompt text or token ids."
    )
    logprobs: int | None = Field(default=None, ge=0, le=20,
                                 description="Return this many top log-probabilities.")
    echo: bool = False
    suffix: str | None = None
