"""Driving the model for one request (engine thread only).

The single-request path reuses mlx-lm's ``generate_step``: it prefills the
prompt in chunks on the first call and then pipelines decoding (the graph of
token ``n+1`` is queued with ``async_eval`` before token ``n`` is read), which
is what keeps one stream as fast as ``mlx_lm.generate``. Interleaving several
requests calls each request's generator once per engine step; each keeps its
own pipeline, caches and sampler.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

from server.generation import FinishReason, TokenEvent
from server.request_state import RequestState
from server.sampling import build_logits_processors, build_sampler, token_logprob
from veloxquant_mlx.memory import BlockPoolAllocator
from veloxquant_mlx.memory.pool_backed import build_pooled_caches

# Prompt tokens per prefill chunk; bounds the activation memory of long prompts.
PREFILL_STEP = 512


def start_decoder(state: RequestState, model: Any, pool: BlockPoolAllocator) -> None:
    """Build the request's pool-backed caches and its (lazy) mlx-lm generator.

    Nothing runs on the model yet: the prefill happens at the first
    :func:`decode_one`, so admission stays cheap.
    """
    params = state.request.params
    state.caches = build_pooled_caches(model, pool, state.owner)
    state.decoder = generate_step(
        mx.array(state.prompt_ids),
        model,
        max_tokens=params.max_tokens,
        sampler=build_sampler(params),
        logits_processors=build_logits_processors(params) or None,
        prompt_cache=state.caches,
        prefill_step_size=PREFILL_STEP,
    )


def decode_one(state: RequestState, tokenizer: Any) -> TokenEvent | None:
    """Generate the request's next token and account for it.

    Returns:
        The event to stream, or None (EOS); ``state.finish`` is set when the
        request is done.
    """
    try:
        token, logprobs = next(state.decoder)
    except StopIteration:
        # The generator ran out at max_tokens; accept_token normally ends first.
        state.finish = FinishReason.LENGTH
        return None
    params = state.request.params
    logprob = None
    if params.logprobs:
        logprob = token_logprob(logprobs, token, params.top_logprobs, tokenizer.decode)
    return state.accept_token(token, logprob)


def memory_snapshot() -> dict[str, int]:
    """MLX allocator counters in bytes (active, cache, peak)."""
    return {
        "active": int(mx.get_active_memory()),
        "cache": int(mx.get_cache_memory()),
        "peak": int(mx.get_peak_memory()),
    }
