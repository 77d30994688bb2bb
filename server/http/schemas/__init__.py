"""OpenAI-compatible request and response models, one module per endpoint."""

from server.http.schemas.chat import ChatCompletionRequest, ChatMessage
from server.http.schemas.common import SamplingFields, StreamOptions
from server.http.schemas.completions import CompletionRequest

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "SamplingFields",
    "StreamOptions",
]
