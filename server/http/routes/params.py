"""Turning a request body into the engine's sampling parameters (server defaults, limits)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

from fastapi import Request

from server.http.errors import (
    REQUEST_ID_STATE,
    APIError,
    InvalidRequestError,
    fresh_request_id,
    quoted,
)
from server.http.schemas.common import SamplingFields
from server.protocol import SamplingParams
from server.settings import Settings

# A token id key: ASCII digits with an optional minus. str.isdigit() is not enough:
# it accepts "²" and other Unicode digits that int() refuses. At most 18 digits: no
# vocabulary is larger, and int() refuses strings of over 4,300 digits.
_TOKEN_ID = re.compile(r"-?[0-9]{1,18}")
# MLX's PRNG key takes an unsigned 64-bit seed; the API's seeds are int64.
SEED_MODULUS = 2**64


def cache_namespace(request: Request, salt: str | None) -> str | None:
    """The prefix-cache namespace of a request (``GenerationRequest.cache_salt``).

    The client's ``cache_salt``; with ``cache.isolation = "api_key"``, inside the
    namespace of the bearer token it presented, so a client never matches
    blocks another key's prompts left (the token is hashed, never kept).
    """
    if request.app.state.settings.cache.isolation != "api_key":
        return salt
    token = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
    return f"key:{hashlib.sha256(token).hexdigest()}:{salt or ''}"


def new_id(prefix: str, request: Request | None = None, sep: str = "-") -> str:
    """A generation's id such as ``cmpl-3f2a...``: the HTTP request's ``x-request-id``
    after the prefix when there is one (so either finds the request's log line)."""
    request_id = getattr(request.state, REQUEST_ID_STATE, None) if request else None
    return f"{prefix}{sep}{request_id or fresh_request_id()}"


def _token_id(key: str) -> int:
    """A ``logit_bias`` key as a token id (range checked by the engine against the vocabulary).

    Raises:
        InvalidRequestError: The key is not a decimal integer.
    """
    if _TOKEN_ID.fullmatch(key) is None:
        raise InvalidRequestError(f"logit_bias key {quoted(key)} is not a token id: use a decimal "
                                  "integer such as \"50256\"", param="logit_bias",
                                  code="invalid_value")
    return int(key)


def check_model(requested: str | None, engine: Any) -> None:
    """404 when the client names a model this server does not serve.

    Any of the model's served names is accepted (``model.served_name`` may list aliases),
    and ``"default"``.
    """
    if requested and requested not in (*engine.served_names, "default"):
        names = ", ".join(repr(name) for name in engine.served_names)
        raise APIError(
            f"model {quoted(requested)} is not served here; this server serves "
            f"{names} (see GET /v1/models)",
            param="model", code="model_not_found", status=404,
        )


def resolve_params(
    body: SamplingFields,
    settings: Settings,
    max_tokens: int | None,
    *,
    logprobs: bool = False,
    top_logprobs: int = 0,
    max_tokens_field: str = "max_tokens",
) -> SamplingParams:
    """Apply server defaults and limits to the request's sampling fields.

    The seed (int64) becomes MLX's unsigned 64-bit key as ``seed mod 2**64``
    (-1 is key 2**64 - 1): one key per seed, and ``mx.random.key`` never sees
    a negative number, which it refuses.

    ``max_tokens_field`` is the request field ``max_tokens`` came from, named
    when it is over the cap (chat's ``max_completion_tokens``).

    Raises:
        InvalidRequestError: Too many/long stop strings, max_tokens over the
            cap, or a bad logit_bias key.
    """
    limits, defaults = settings.limits, settings.sampling
    stops = body.stop_list()
    if len(stops) > limits.max_stop_sequences:
        raise InvalidRequestError(f"{len(stops)} stop sequences given, at most "
                                  f"{limits.max_stop_sequences} allowed", param="stop")
    if any(len(s) > limits.max_stop_length or not s for s in stops):
        raise InvalidRequestError(f"each stop sequence must have 1..{limits.max_stop_length} "
                                  "characters", param="stop")
    defaulted = max_tokens is None
    max_tokens = limits.default_max_tokens if defaulted else max_tokens
    if max_tokens > limits.max_tokens_cap:
        raise InvalidRequestError(f"{max_tokens_field}={max_tokens} is over this server's cap "
                                  f"of {limits.max_tokens_cap} (limits.max_tokens_cap)",
                                  param=max_tokens_field)
    bias = [(_token_id(key), float(value)) for key, value in (body.logit_bias or {}).items()]

    def pick(value, default):
        return default if value is None else value

    top_k = pick(body.top_k, defaults.top_k)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=pick(body.temperature, defaults.temperature),
        top_p=pick(body.top_p, defaults.top_p),
        top_k=max(top_k, 0),
        min_p=pick(body.min_p, defaults.min_p),
        seed=None if body.seed is None else body.seed % SEED_MODULUS,
        stop=tuple(stops),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=body.presence_penalty or None,
        frequency_penalty=body.frequency_penalty or None,
        repetition_penalty=body.repetition_penalty,
        logit_bias=tuple(bias),
        max_tokens_param=max_tokens_field,
        max_tokens_defaulted=defaulted,
        ignore_eos=body.ignore_eos,
    )


def for_choice(params: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i``'s parameters: with a seed, ``seed + i``, so choices differ but repeat."""
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % SEED_MODULUS)


def check_stream_options(body: SamplingFields) -> None:
    """``stream_options`` without ``stream: true`` is a 400, as OpenAI answers."""
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options is only allowed with stream: true",
                                  param="stream_options")


def check_choices(n: int, n_prompts: int, settings: Settings) -> None:
    """n x prompts choices at most ``limits.max_choices`` (each is its own generation)."""
    cap = settings.limits.max_choices
    if n * n_prompts > cap:
        what = f"n={n}" if n_prompts == 1 else f"n={n} x {n_prompts} prompts"
        raise InvalidRequestError(f"{what} asks for {n * n_prompts} choices, more than this "
                                  f"server's limits.max_choices={cap}; ask for fewer or send "
                                  "several requests", param="n" if n > 1 else "prompt")
