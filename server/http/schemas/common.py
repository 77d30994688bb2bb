"""Fields shared by the completions and chat endpoints."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    """``stream_options``: ask for a final usage chunk on a stream."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Sampling and stopping fields of both generation endpoints.

    ``None`` means "use the server default" (``[sampling]`` in the config).
    Ranges follow the OpenAI API; out-of-range values answer 400 at once.
    Types are strict: ``true`` is not a number, ``"yes"`` not a boolean and
    ``"5"`` not an integer (each is a 400 naming the field); an integer is
    still accepted where a float is expected.
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = Field(default=None, description="Model id; see GET /v1/models.")
    max_tokens: int | None = Field(default=None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="0 or -1 disables.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1,
                             description="Makes sampling repeatable (0..2**64-1).")
    stop: str | list[str] | None = Field(
        default=None, description="Stop strings; excluded from the output."
    )
    n: int = Field(default=1, ge=1, description="Only 1 is supported.")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # Bounded: a penalty near 0 divides logits into inf.
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)
    # OpenAI's range; a far larger bias makes the log-probabilities NaN.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def stop_list(self) -> list[str]:
        """The stop strings as a list (empty when none)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
