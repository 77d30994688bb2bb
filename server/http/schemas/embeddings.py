"""``POST /v1/embeddings``: OpenAI's request body."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from server.http.schemas.common import STRICT_BODY, OpenAIModel


class EmbeddingRequest(OpenAIModel):
    """What to embed: a string, strings, token ids, or lists of token ids."""

    model_config = STRICT_BODY

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    # Only the model's own width: a shortened vector needs a model trained for it.
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
