"""``POST /v1/chat/completions`` request model."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from server.http.errors import InvalidRequestError
from server.http.schemas.common import STRICT_BODY, OpenAIModel, SamplingFields
from server.http.schemas.template_kwargs import TemplateKwargs, checked_template_kwargs


class ToolCallFunction(OpenAIModel):
    """The function part of an earlier tool call (``arguments`` is JSON text)."""

    name: str
    arguments: str


class ToolCall(OpenAIModel):
    """A tool call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIModel):
    """One message; ``content`` may be a string or a list of text parts.

    An assistant message may carry the ``tool_calls`` it made; a ``tool``
    message answers one of them (``tool_call_id``).
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def rendered(self) -> dict[str, Any]:
        """What the chat template gets: role, text content, and any tool-call fields."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        """The message's text, joining text parts; non-text parts are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if (part.get("type") == "refusal" and self.role == "assistant"
                    and isinstance(part.get("refusal"), str)):
                texts.append(part["refusal"])  # a replayed answer's refusal: its words
                continue
            if part.get("type") != "text":
                raise ValueError(f"only text content parts are supported; part {j} has type "
                                 f"{json.dumps(part.get('type'))}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {j} is a text part without a string 'text'")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(SamplingFields):
    """Chat completion: messages in, formatted with the tokenizer's chat template.

    Every field of OpenAI's chat request is declared (tests/server/
    test_openai_fields.py walks the ``openai`` package's list), so none is
    silently dropped: the ones below ``top_logprobs`` are either refused
    unless left at their default (:mod:`server.http.schemas.refusals`), or
    platform hints with no effect on a self-hosted model by definition.
    """

    model_config = STRICT_BODY

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Checked into a plan by server.http.schemas.tools; forced calls use constrained decoding.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Variables for the chat template (server.http.schemas.template_kwargs): vLLM's object,
    # OpenAI's reasoning_effort and the top-level enable_thinking some front ends send.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    enable_thinking: bool | None = None
    # Refused unless left at their default (refusals.refuse_unsupported).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    moderation: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: dict[str, Any] | None = None
    # No effect by definition: OpenAI platform metadata, storage, caching and billing hints,
    # and predicted output (a latency hint that never changes the answer).
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None

    def template_kwargs(self) -> TemplateKwargs:
        """The chat template's extra variables (:mod:`server.http.schemas.template_kwargs`).

        Raises:
            InvalidRequestError: A ``chat_template_kwargs`` key the server sets itself.
        """
        return checked_template_kwargs(self.chat_template_kwargs,
                                       reasoning_effort=self.reasoning_effort,
                                       enable_thinking=self.enable_thinking)

    def check_logprobs(self) -> None:
        """``top_logprobs`` needs ``logprobs: true`` (a 400 naming it, as OpenAI answers).

        Not a model validator: its error would name the whole body, not the field.
        """
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs: true",
                                      param="top_logprobs")
