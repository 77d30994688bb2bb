"""What routes hand to the engine and what comes back, as named records.

A route builds a :class:`GenerationRequest` and submits it; the engine
thread answers through the request's channel (server.channel) with, in
order, one :class:`Admitted` (or one :class:`Rejected`), then
:class:`TokenEvent` records, then exactly one :class:`Finished` (or
:class:`Failed`).

Refusals and failures carry a :class:`~server.refusal.Reason`; what a reason
means to an HTTP client (status, ``Retry-After``), and how a refusal's figures
read (server.refusal), is decided by the HTTP layer alone.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any

from server.refusal import Reason, Rejected, Why


class FinishReason(str, enum.Enum):
    """Why a request stopped generating."""

    STOP = "stop"  # EOS token or a stop sequence
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the client went away or gave up (never sent to a client)
    ERROR = "error"  # it failed (see the Reason of its Failed event)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Resolved sampling settings of one request (server defaults applied).

    ``constraint`` is a compiled grammar the output must follow
    (:func:`server.text.schemas.compile_response_format`), shared by
    every request that asks for the same format; None for free text.

    ``max_tokens_param`` is the request field ``max_tokens`` came from (chat's
    ``max_completion_tokens``, Responses' ``max_output_tokens``), named when it
    cannot be honoured; ``max_tokens_defaulted`` says the client left it out,
    so the engine may lower it to the room the context and the pool leave.

    ``ignore_eos`` is the client's (vLLM's and llama.cpp's extension): the
    answer runs to ``max_tokens`` or a stop string. The preparer turns it into
    ``banned_tokens``, the model's end tokens, which the runner never samples.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Any = None
    max_tokens_param: str = "max_tokens"
    max_tokens_defaulted: bool = False
    ignore_eos: bool = False
    banned_tokens: tuple[int, ...] = ()


# How a model without a tool-aware chat template is asked to write a tool call
# (server.text.chat_render) and how the HTTP side finds it in the text.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class ConstraintError(ValueError):
    """A ``response_format`` (or tool schema) the server cannot enforce: a client error.

    Raised by :meth:`server.engine.engine.Engine.compile_constraint`.

    Attributes:
        message: What is wrong, naming the field.
        param: The request field at fault.
    """

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Chat messages still to be rendered with the tokenizer's template.

    Attributes:
        messages: ``role`` and ``content`` (a string); an assistant message may
            carry ``tool_calls`` (OpenAI's shape) and a tool message ``tool_call_id``.
        tools: OpenAI tool objects offered to the model (rendered by
            :mod:`server.text.chat_render`); empty for none.
        generation_prompt: End with the template's opening of the assistant's turn
            (always, to generate; ``/tokenize`` may leave it out, as vLLM's does).
        template_kwargs: Extra variables for the template, as (name, value) pairs
            (``chat_template_kwargs``, ``reasoning_effort``, ``enable_thinking``).
    """

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    generation_prompt: bool = True
    template_kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(slots=True)
class GenerationRequest:
    """One request as the engine sees it.

    Attributes:
        request_id: The id returned to the client (``cmpl-...``).
        prompt: Text, token ids, or a :class:`ChatPrompt` (tokenized by the engine).
        params: Sampling and stopping settings.
        channel: Where events for this request go.
        score: Score the prompt's own tokens with this many alternatives a position
            and generate nothing (completions ``echo``; ``params.max_tokens`` is 0);
            None for a generation. See :mod:`server.engine.tasks`.
        embed: Pool the prompt's final hidden states (``"mean"`` or ``"last"``) into
            an embedding and generate nothing (``/v1/embeddings``); None otherwise.
        cache_salt: Prefix-cache namespace: its blocks match only prompts sent
            under the same salt (None: the shared namespace).
        choices: The sibling choices it is admitted with, all or none (None: alone).
    """

    request_id: str
    prompt: str | list[int] | ChatPrompt
    params: SamplingParams
    channel: Any  # its server.channel.EventChannel (which carries these records)
    cancelled: threading.Event = field(default_factory=threading.Event)
    score: int | None = None
    embed: str | None = None
    cache_salt: str | None = None
    choices: Any = None

    @property
    def whole_prompt(self) -> bool:
        """It reads every prompt position (scoring, embedding): no cached prefix applies."""
        return self.score is not None or self.embed is not None

    def cancel(self) -> None:
        """Ask the engine to stop this request; safe from any thread, idempotent."""
        self.cancelled.set()


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """The text that opens and the text that closes a model's think block
    (:mod:`server.text.think_tags`)."""

    start: str
    end: str


@dataclass(eq=False, slots=True)
class ChoiceGroup:
    """The engine requests of one prompt's ``n`` choices, admitted together or refused
    together (:mod:`server.engine.request_state`).

    Attributes:
        members: Every choice's request, in choice order.
    """

    members: list[GenerationRequest] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Choices in the group."""
        return len(self.members)


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One alternative token and its log-probability.

    ``raw`` is the token's own bytes (part of a character, possibly), where the
    answer reports them (chat); None elsewhere.
    """

    token: str
    logprob: float
    token_id: int
    raw: bytes | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of a generated token, with the top alternatives (``raw``: as above)."""

    token: str
    logprob: float
    token_id: int
    top: tuple[TopLogprob, ...] = ()
    raw: bytes | None = None


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request got its reservation and is running."""

    owner: int
    prompt_tokens: int
    reserved_blocks: int


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New output text (possibly empty while a stop string is being matched).

    ``logprobs``: the records of the tokens whose text this event completes, in
    order (none while a token's text is held back; several when held text is
    released; empty when the client asked for none).
    """

    text: str
    token_id: int
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """Token and block accounting of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    kv_blocks: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def as_dict(self) -> dict[str, Any]:
        """OpenAI ``usage`` object (``prompt_tokens_details.cached_tokens`` included) plus
        our ``kv_blocks``."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "kv_blocks": self.kv_blocks,
        }


@dataclass(frozen=True, slots=True)
class Finished:
    """The request ended; ``text`` is output held back until the end (stop matching);
    ``result``: a whole-prompt task's (a scoring request's
    :class:`server.engine.tasks.PromptScores`, an embedding's
    :class:`server.engine.tasks.PromptEmbedding`)."""

    reason: FinishReason
    usage: Usage
    text: str = ""
    result: Any = None


@dataclass(frozen=True, slots=True)
class Failed:
    """The request ended without finishing (model error, or the engine stopping).

    Other requests go on after a model error.
    """

    reason: Reason
    message: str
    usage: Usage | None = None


Event = Admitted | Rejected | TokenEvent | Finished | Failed


@dataclass(frozen=True, slots=True)
class ConversationSize:
    """What a conversation holds, as the bound counts it.

    Attributes:
        messages: Messages the chat template renders.
        chars: Characters of text the template writes whole (see the module doc).
    """

    messages: int
    chars: int

    def __add__(self, other: ConversationSize) -> ConversationSize:
        return ConversationSize(self.messages + other.messages, self.chars + other.chars)


@dataclass(frozen=True, slots=True)
class ConversationBound:
    """The sizes past which a conversation cannot fit ``limits.max_prompt_tokens``.

    Attributes:
        max_prompt_tokens: ``limits.max_prompt_tokens``.
        max_messages: The most messages that may fit (None: the template does not
            frame every message, so no count bound).
        max_chars: The most characters that may fit (None: the tokenizer has no
            sound per-token bound).
        chars_per_token: ``B``, the most characters one token covers (None with
            ``max_chars``).
    """

    max_prompt_tokens: int
    max_messages: int | None
    max_chars: int | None
    chars_per_token: int | None

    def fits(self, size: ConversationSize) -> bool:
        """Whether a conversation of ``size`` may fit (False proves it cannot)."""
        return ((self.max_messages is None or size.messages <= self.max_messages)
                and (self.max_chars is None or size.chars <= self.max_chars))

    def refusal(self, size: ConversationSize, field: str) -> Rejected | None:
        """The 400 for a conversation of ``size`` that cannot fit, naming ``field``
        (``messages``, ``input``); None when it may fit."""
        limit = self.max_prompt_tokens
        if self.max_messages is not None and size.messages > self.max_messages:
            return Rejected(Why.CONVERSATION_MESSAGES,
                            {"messages": size.messages, "limit": limit}, field)
        if self.max_chars is not None and size.chars > self.max_chars:
            return Rejected(Why.CONVERSATION_CHARS, {"chars": size.chars, "limit": limit,
                                                     "per_token": self.chars_per_token}, field)
        return None


class ShrinkRefused(Exception):
    """An admin shrink would leave the pool unable to hold one maximal request.

    Raised (through the shrink's future) unless the shrink was forced; the
    message gives the numbers and the ways out.
    """
