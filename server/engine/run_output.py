"""What the model runner hands back to the engine after a prefill or decode pass.

Bare owner ids, token ids and errors: the runner knows nothing of text or
clients; :mod:`server.engine.steps` turns these into client events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

# Called with a row's owner right before each model call that row takes part in;
# raising fails that row alone (fault injection in tests).
RowHook = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Sampled:
    """A token a model call produced for a row.

    Attributes:
        owner: The row's owner id.
        token: The token id.
        logprobs: The ``(vocab,)`` log-probabilities it was drawn from (None
            unless the row asked for them).
    """

    owner: int
    token: int
    logprobs: mx.array | None


@dataclass(frozen=True, slots=True)
class RowFailure:
    """A row whose model work raised; it has already left the runner.

    Attributes:
        owner: The row's owner id.
        error: What was raised.
        held: Blocks the row held just before it left.
    """

    owner: int
    error: Exception
    held: int


@dataclass(frozen=True, slots=True)
class TaskDone:
    """A row whose whole-prompt task is done; it has already left the runner.

    Attributes:
        owner: The row's owner id.
        result: The task (:class:`server.engine.scoring.PromptScores`,
            :class:`server.engine.embedding.PromptEmbedding`).
        held: Blocks the row held just before it left.
    """

    owner: int
    result: Any
    held: int


@dataclass(slots=True)
class RunOutput:
    """What one prefill or decode pass produced.

    Attributes:
        tokens: Sampled tokens, at most one per row.
        failed: Rows whose model work raised.
        rows: Rows in the batched decode call (0: no call, or a prefill pass).
        calls_ran: Model calls handed to the device without raising.
        call_error: What the last model call that raised raised (its rows are in
            ``failed`` or, for a prefill group, restart alone), else None.
        tasks_done: Rows whose whole-prompt task is done (a prefill pass).
    """

    tokens: list[Sampled] = field(default_factory=list)
    failed: list[RowFailure] = field(default_factory=list)
    rows: int = 0
    calls_ran: int = 0
    call_error: Exception | None = None
    tasks_done: list[TaskDone] = field(default_factory=list)
