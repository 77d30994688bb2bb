"""``POST /tokenize`` and ``POST /detokenize`` request models.

vLLM's fields (``prompt``, ``add_special_tokens``, ``return_token_strs``) and
llama.cpp's (``content``, ``add_special``, ``parse_special``, ``with_pieces``)
are both read, each name with its own server's default, so either server's
clients get the answer they expect.
"""

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
    content: str | None = Field(default=None, description="Text: llama.cpp's name for prompt.")
    messages: list[ChatMessage] | None = Field(
        default=None, min_length=1, description="A conversation, as /v1/chat/completions "
                                                "takes it.")
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="With messages: the tools offered, rendered into the prompt.")
    tool_choice: str | dict[str, Any] | None = Field(
        default=None, description="With tools, as chat takes it: \"none\" offers none, a "
                                  "named function only that one.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="With messages (vLLM's option): extra variables for the "
                                  "chat template, as chat takes them.")

    add_generation_prompt: bool = Field(
        default=True, description="With messages (vLLM's option): end with the opening of "
                                  "the assistant's turn, as a chat runs.")
    add_special_tokens: bool | None = Field(
        default=None, description="Text only: put the tokenizer's special tokens (a BOS) in "
                                  "front, as a completion does (default true).")
    add_special: bool | None = Field(
        default=None, description="llama.cpp's name for add_special_tokens (default false).")
    parse_special: bool = Field(
        default=True, description="Text only: read special-token text such as <|im_start|> "
                                  "as that token (false: as its characters).")
    with_pieces: bool = Field(
        default=False, description="llama.cpp's option: tokens as {id, piece}, the piece a "
                                   "string, or a list of byte values where it is part of a "
                                   "character.")
    return_token_strs: bool = Field(
        default=False, description="vLLM's option: token_strs, each id as the vocabulary "
                                   "writes it.")

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        given = [name for name in ("prompt", "content", "messages")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt (or llama.cpp's content) and messages")
        if (self.tools is not None or self.tool_choice is not None
                or self.chat_template_kwargs is not None) and self.messages is None:
            raise ValueError("tools, tool_choice and chat_template_kwargs go with messages, "
                             "not with prompt")
        if not self.add_generation_prompt and self.messages is None:
            raise ValueError("add_generation_prompt goes with messages, not with a text prompt")
        if self.add_special_tokens is not None and self.add_special is not None:
            raise ValueError("give add_special_tokens or llama.cpp's add_special, not both")
        if self.messages is not None and (self.add_special_tokens or self.add_special
                                          or not self.parse_special):
            raise ValueError("with messages the chat template places the special tokens: "
                             "add_special_tokens/add_special and parse_special=false go with "
                             "a text prompt")
        return self

    @property
    def text(self) -> str | None:
        """The text prompt, whichever name it came under."""
        return self.prompt if self.prompt is not None else self.content

    @property
    def adds_special(self) -> bool:
        """Whether special tokens go in front of the text: each name keeps its server's
        default (vLLM's ``prompt``: yes, as a completion; llama.cpp's ``content``: no)."""
        for choice in (self.add_special_tokens, self.add_special):
            if choice is not None:
                return choice
        return self.content is None


class DetokenizeRequest(OpenAIModel):
    """Token ids to the text they decode to."""

    model: str | None = Field(default=None, description="Model id; see GET /v1/models.")
    tokens: list[int] = Field(..., description="Token ids of the served model's vocabulary.")
