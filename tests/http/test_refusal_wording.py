"""Refusals are records of numbers; the HTTP layer alone words them (server.http.refusals).

Every :class:`~server.refusal.Why` has a sentence, each sentence is built from the
figures the engine records (no engine object words a refusal), and the words a client
reads name the field and the numbers that let it fix the request.
"""

from __future__ import annotations

import dataclasses

import pytest

from server.http.errors import engine_error
from server.http.refusals import _WORDING, describe
from server.refusal import PoolMisfit, Reason, Rejected, Why

MISFIT = PoolMisfit(n_tokens=81, blocks=12, stream="k", have=10, most_tokens=80, n_layers=2,
                    block_size=16, shared_stream=False)
CONTEXT = {"context": 2048, "context_configured": False}

# One real record of each kind, with the figures its engine site records.
SAMPLES = {
    Why.EMPTY_PROMPT: Rejected(Why.EMPTY_PROMPT, param="prompt"),
    Why.UNTOKENIZABLE: Rejected(Why.UNTOKENIZABLE, {"error": "bad byte"}, "messages"),
    Why.LONE_SURROGATE: Rejected(Why.LONE_SURROGATE, {"codepoint": 0xD800, "index": 3},
                                 "prompt"),
    Why.OUT_OF_VOCAB: Rejected(Why.OUT_OF_VOCAB, {"token": 70000, "vocab": 49152},
                               "logit_bias"),
    Why.IGNORE_EOS_WITH_GRAMMAR: Rejected(Why.IGNORE_EOS_WITH_GRAMMAR, param="ignore_eos"),
    Why.PROMPT_BYTES_OVER_LIMIT: Rejected(Why.PROMPT_BYTES_OVER_LIMIT,
                                          {"bytes": 90000, "limit": 4096}, "prompt"),
    Why.PROMPT_OVER_LIMIT: Rejected(Why.PROMPT_OVER_LIMIT, {"tokens": 5000, "limit": 4096},
                                    "messages"),
    Why.PROMPT_OVER_CONTEXT: Rejected(Why.PROMPT_OVER_CONTEXT, {"tokens": 3000, **CONTEXT},
                                      "prompt"),
    Why.CONVERSATION_MESSAGES: Rejected(Why.CONVERSATION_MESSAGES,
                                        {"messages": 5000, "limit": 4096}, "messages"),
    Why.CONVERSATION_CHARS: Rejected(Why.CONVERSATION_CHARS,
                                     {"chars": 10**6, "limit": 4096, "per_token": 16}, "input"),
    Why.NO_ROOM_IN_CONTEXT: Rejected(Why.NO_ROOM_IN_CONTEXT, {"tokens": 2048, **CONTEXT},
                                     "prompt"),
    Why.NO_ROOM_IN_POOL: Rejected(Why.NO_ROOM_IN_POOL, {"tokens": 900, "pool_tokens": 896},
                                  "messages"),
    Why.OVER_CONTEXT: Rejected(Why.OVER_CONTEXT, {
        "tokens": 2000, "max_tokens": 100, "fits": 48, "pool": None, "prompt_field": "prompt",
        **CONTEXT}, "max_tokens"),
    Why.NEVER_FITS_POOL: Rejected(Why.NEVER_FITS_POOL, {"misfit": MISFIT, "room": 77},
                                  "max_tokens"),
    Why.GROUP_NEVER_FITS: Rejected(Why.GROUP_NEVER_FITS, {
        "misfit": MISFIT, "size": 6, "field": "n x max_tokens"}, "n"),
    Why.PREPARER_BUSY: Rejected(Why.PREPARER_BUSY, {"pending": 40}),
    Why.QUEUE_FULL: Rejected(Why.QUEUE_FULL, {"waiting": 2, "max_queue": 2}),
    Why.QUEUE_TIMEOUT: Rejected(Why.QUEUE_TIMEOUT, {"timeout_s": 30.0}),
    Why.CANCELLED_WAITING: Rejected(Why.CANCELLED_WAITING),
    Why.SHUTTING_DOWN: Rejected(Why.SHUTTING_DOWN),
    Why.MODEL_NOT_LOADED: Rejected(Why.MODEL_NOT_LOADED),
    Why.ENGINE_STOPPED: Rejected(Why.ENGINE_STOPPED, {"error": "RuntimeError: lost rank"}),
    Why.PREPARE_FAILED: Rejected(Why.PREPARE_FAILED, {"error": "KeyError: 'x'"}),
}


def test_every_why_is_worded_and_sampled():
    assert set(_WORDING) == set(Why) == set(SAMPLES)


def test_a_refusal_record_holds_no_words():
    """The engine's record is its kind, figures and field: nothing a person reads."""
    assert [f.name for f in dataclasses.fields(Rejected)] == ["why", "figures", "param"]


@pytest.mark.parametrize("why", list(Why))
def test_each_sentence_reads_from_its_figures(why):
    event = SAMPLES[why]
    text = describe(event)
    assert text and text[0].islower() and "{" not in text  # a sentence, not a template
    for value in event.figures.values():
        if isinstance(value, (int, str)) and not isinstance(value, bool) and value != "":
            # Every number and name the engine recorded shows up (vocab as its last id).
            shown = value - 1 if why is Why.OUT_OF_VOCAB and value == 49152 else value
            assert str(shown) in text or (why is Why.LONE_SURROGATE and "U+D800" in text), (
                why, value, text)


def test_the_words_name_the_fix():
    assert describe(SAMPLES[Why.NEVER_FITS_POOL]) == (
        "prompt plus max_tokens (81 tokens) needs 12 KV blocks on stream 'k' (2 layers x "
        "ceil(81/16)), but the pool holds at most 10 there; lower max_tokens or shorten the "
        "prompt to fit 80 tokens in total, or raise pool.n_blocks (or pool.max_blocks with "
        "pool.grow_on_exhaustion); with this prompt, max_tokens can be at most 77")
    assert describe(SAMPLES[Why.OVER_CONTEXT]) == (
        "the prompt's 2000 tokens plus max_tokens=100 come to 2100 tokens, over the model's "
        "context of 2048 tokens (the model's max_position_embeddings); lower max_tokens to at "
        "most 48, or shorten the prompt")
    configured = dataclasses.replace(SAMPLES[Why.NO_ROOM_IN_CONTEXT], figures={
        "tokens": 2048, "context": 1024, "context_configured": True})
    assert "the served context of 1024 tokens (limits.max_context_tokens)" in describe(configured)
    assert describe(SAMPLES[Why.OUT_OF_VOCAB]).startswith("logit_bias token id 70000")


@pytest.mark.parametrize("why", list(Why))
def test_the_http_error_carries_the_words_the_code_and_the_field(why):
    event = SAMPLES[why]
    if why.reason is Reason.CANCELLED_WAITING:
        return  # never answered: the client is gone
    error = engine_error(event)
    assert error.code == why.reason.value and error.param == event.param
    assert describe(event) in error.message
