"""Embeddings of a prompt: its final hidden states, pooled and normalized (``/v1/embeddings``).

An embedding is a request like a generation: queued, admitted against the
pool, its KV in pool blocks under its own owner (a prompt longer than one chunk
attends to its earlier chunks there), prefilled alone in chunks within each
step's prefill budget, cancelled between chunks, its blocks back at the end::

    route     GenerationRequest(embed="mean", max_tokens=0) per input -> submit
    runner    each chunk: the model's backbone (``model.model``: the layers and the
              final norm, no vocabulary projection) -> (chunk, hidden) states,
              summed (mean) or the last kept (last)          PromptEmbedding.step
    end       Finished(result=PromptEmbedding) -> route: vector(), base64 or floats

Pooling follows sentence-transformers' conventions: the mean over every prompt
position, or the last position's state (what decoder embedding models such as
e5-mistral and Qwen3-Embedding read), then scaled to unit length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POOLINGS = ("mean", "last")


def can_embed(model: Any) -> bool:
    """Whether ``model`` exposes its backbone (``model.model``), whose output is the final
    hidden states: mlx-lm's decoder families (llama, qwen, mistral, gemma, phi3...)."""
    return callable(getattr(model, "model", None))


@dataclass(slots=True)
class PromptEmbedding:
    """One prompt's pooled hidden states, filled chunk by chunk on the engine thread.

    Attributes:
        ids: The prompt's token ids.
        pooling: ``"mean"`` or ``"last"``.
        fed: Prompt tokens run through the model so far.
        pooled: The running sum (mean) or the last state (last), float32; None before
            the first chunk.
        vector: The embedding once every token is in (unit length, Python floats:
            the route reads it off the engine thread, where no MLX work may run).
    """

    ids: list[int]
    pooling: str = "mean"
    fed: int = 0
    pooled: Any = None
    vector: list[float] | None = None

    @property
    def done(self) -> bool:
        """Every prompt token went through the model."""
        return self.fed >= len(self.ids)

    def step(self, model: Any, cache: list, positions: int) -> int:
        """Run the next ``positions`` prompt tokens through ``model``'s backbone.

        Returns:
            Tokens fed (0 when done).
        """
        import mlx.core as mx

        start, end = self.fed, min(self.fed + positions, len(self.ids))
        if end <= start:
            return 0
        hidden = model.model(mx.array(self.ids[start:end])[None], cache)[0]
        hidden = hidden.astype(mx.float32)
        if self.pooling == "last":
            part = hidden[-1]
        else:
            part = hidden.sum(axis=0)
            part = part if self.pooled is None else self.pooled + part
        self.pooled = part
        mx.eval(self.pooled)
        self.fed = end
        if self.done:
            self.vector = _unit(self.pooled / len(self.ids) if self.pooling == "mean"
                                else self.pooled)
        return end - start


def _unit(pooled: Any) -> list[float]:
    import mlx.core as mx

    norm = mx.sqrt(mx.sum(pooled * pooled))
    return (pooled / mx.maximum(norm, 1e-12)).tolist()

