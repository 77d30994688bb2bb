"""Fields shared by the completions and chat endpoints."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The OpenAI API's seed range (int64). MLX's key takes 0..2**64-1: seeds map onto it
# modulo 2**64 (server.http.routes.params.resolve_params).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class OpenAIModel(BaseModel):
    """Base of every request body: strict types, and JSON ``null`` means "not given".

    The official ``openai`` client (and most others) sends an unset optional
    field as ``null``; the spec marks those fields nullable. Dropping the
    ``null`` keys before validation gives each one its default, in one place,
    instead of a nullable type on every field.
    """

    # NaN and Infinity are not JSON, but Python's parser reads them: refused as what
    # they are, instead of failing a range check ("less than or equal to 2") they never met.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


# The endpoints' own bodies. Every field of the ``openai`` package's request types is
# declared (tests/http/test_openai_fields.py); a field none of them knows is left out
# here and handled by ``server.unknown_fields`` before validation (ignored and logged, or
# a 400 naming it: server/http/unknown_fields.py). Nested objects (messages, tools) keep
# extra keys too: clients send back the SDK's own message objects, whose keys differ
# between releases.
STRICT_BODY = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    """``stream_options``: ask for a final usage chunk on a stream."""

    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Sampling and stopping fields of both generation endpoints.

    Absent (or ``null``) means "use the server default" (``[sampling]`` in the
    config). Ranges follow the OpenAI API; out-of-range values answer 400 at
    once. Types are strict: ``true`` is not a number, ``"yes"`` not a boolean
    and ``"5"`` not an integer (each is a 400 naming the field); an integer is
    still accepted where a float is expected.

    A field the server cannot honour is declared anyway and refused unless
    left at its default (:mod:`server.http.schemas.refusals`), so it is never
    silently ignored (on the endpoints' own models).
    """

    model: str | None = Field(default=None, description="Model id; see GET /v1/models.")
    max_tokens: int | None = Field(default=None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="0 or -1 disables.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX,
                             description="Makes sampling repeatable (int64; MLX's key is the "
                                         "seed modulo 2**64). Choice i of n uses seed + i.")
    stop: str | list[str] | None = Field(
        default=None, description="Stop strings; excluded from the output."
    )
    n: int = Field(default=1, ge=1, description="Choices per prompt (limits.max_choices bounds "
                                                "n x prompts).")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # Bounded: a penalty near 0 divides logits into inf.
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)
    # OpenAI's range; a far larger bias makes the log-probabilities NaN.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(
        default=None, description="Only with stream: true (400 otherwise, as OpenAI).")
    user: str | None = None
    cache_salt: str | None = Field(
        default=None, min_length=1, description="Prefix-cache namespace (vLLM's field): "
        "cached prompt blocks are shared only by requests with the same salt.")
    # "text", "json_object" or "json_schema": enforced by constrained decoding
    # (server.http.routes.structured).
    response_format: dict[str, Any] | None = None
    # vLLM's and llama.cpp's extension, which load generators send for fixed-length answers.
    ignore_eos: bool = Field(default=False, description="End tokens are never sampled: the "
                             "answer runs to max_tokens or a stop string.")

    def stop_list(self) -> list[str]:
        """The stop strings as a list (empty when none)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
