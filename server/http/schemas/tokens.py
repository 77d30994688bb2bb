"""``POST /tokenize`` and ``POST /detokenize`` request models (vLLM's shape)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from server.http.schemas.chat import ChatMessage
from server.http.schemas.common import OpenAIModel


class TokenizeRequest(OpenAIModel):
    """Text (``prompt``) or a conversation (``messages``, ``tools``) to prompt ids.

    The ids are the ones a generation request with the same prompt would run
    on: the completions prompt as the tokenizer encodes it, or the messages
    rendered with the chat template and its generation prompt.
    """

    model: str | None = Field(default=None, description="Model id; see GET /v1/models.")
    prompt: str | None = Field(default=None, description="Text, as /v1/completions takes it.")
    messages: list[ChatMessage] | None = Field(
        default=None, min_length=1, description="A conversation, as /v1/chat/completions "
                                                "takes it.")
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="With messages: the tools offered, rendered into the prompt.")
    tool_choice: str | dict[str, Any] | None = Field(
        default=None, description="With tools, as chat takes it: \"none\" offers none, a "
                                  "named function only that one.")

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if (self.tools is not None or self.tool_choice is not None) and self.messages is None:
            raise ValueError("tools and tool_choice go with messages, not with prompt")
        return self


class DetokenizeRequest(OpenAIModel):
    """Token ids to the text they decode to."""

    model: str | None = Field(default=None, description="Model id; see GET /v1/models.")
    tokens: list[int] = Field(..., description="Token ids of the served model's vocabulary.")
