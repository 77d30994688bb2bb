"""OpenAI-compatible request and response models, one module per endpoint."""

from server.schemas.chat import ChatCompletionRequest, ChatMessage
from server.schemas.common import SamplingFields, StreamOptions
from server.schemas.completions import CompletionRequest

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "SamplingFields",
    "StreamOptions",
]
