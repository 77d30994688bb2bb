"""What the model runner hands back after a pass, how long each step phase took
(:class:`StepClock`), and whether the model's calls still run (:class:`CallHealth`).

Bare owner ids, token ids and errors: the runner knows nothing of text or
clients; :mod:`server.engine.steps` turns these into client events.
"""

from __future__ import annotations

import logging
import time
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
        result: The task (:class:`server.engine.tasks.PromptScores`,
            :class:`server.engine.tasks.PromptEmbedding`).
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



# Whether the model's calls still run: failed calls in a row, for ``/health``.
#
# A model call that raises fails the requests in it, and the engine goes on: most such
# errors belong to one call (a batch too large for the device's memory right now). Some
# do not go away. On MLX's CUDA backend an error thrown while a step's graph is committed
# leaves that stream's command encoder broken, and every later call fails the same way
# (ml-explore/mlx#4326) until the process restarts. The server then answered every
# request with an error while ``/health`` still said ok, so nothing would restart it.
#
# :class:`CallHealth` counts the model calls that failed since the last one that ran;
# from :data:`FAILED_CALLS_UNHEALTHY` on, ``/health`` answers 503 with the last error,
# which a supervisor's liveness probe acts on. Requests are still admitted meanwhile:
# only a call that runs can show that the device works again, and the first one that
# does makes ``/health`` ok again.

log = logging.getLogger("veloxquant.server")

# Failed model calls in a row that make /health say 503. One is often a batch that did
# not fit; three with no call running in between is a device that stopped working.
FAILED_CALLS_UNHEALTHY = 3


class CallHealth:
    """Failed model calls since the last call that ran (engine thread writes, any reads)."""

    def __init__(self, unhealthy_after: int = FAILED_CALLS_UNHEALTHY) -> None:
        self.unhealthy_after = unhealthy_after
        self.failed_in_row = 0
        self.last_error = ""

    def record(self, out: RunOutput) -> None:
        """Count a pass's model calls: any that ran clears the count, else a failure adds one."""
        if out.calls_ran:
            if self.failed_in_row >= self.unhealthy_after:
                log.warning("model calls run again after %d failed in a row",
                            self.failed_in_row)
            self.failed_in_row = 0
        elif out.call_error is not None:
            self.failed_in_row += 1
            self.last_error = f"{type(out.call_error).__name__}: {out.call_error}"
            if self.failed_in_row == self.unhealthy_after:
                log.error("%d model calls failed in a row (last: %s); /health says 503 "
                          "until one runs", self.failed_in_row, self.last_error)

    @property
    def failing(self) -> str | None:
        """Why the model is failing (for ``/health``), or None while it runs."""
        if self.failed_in_row < self.unhealthy_after:
            return None
        return f"the last {self.failed_in_row} model calls failed (last: {self.last_error})"



# Where the engine thread's time goes, phase by phase (read on ``/metrics``).
#
# A decode step on a GPU is bound by host work, not by the device: building
# the model's graph, launching it, reading the tokens, detokenizing and
# handing events to the clients. The clock splits each step into phases with
# one ``perf_counter`` call per phase boundary (well under a microsecond), so
# it stays on in production and ``/metrics`` answers "where does a step's time
# go?" under the real load::
#
#     schedule      expiry, admission, cancellations
#     prefill       prefill model calls (graph, chunk submits, first tokens)
#     decode_graph  the batched decode's model graph, paged-KV bookkeeping included
#     sample_graph  the sampling graph of that decode
#     submit        async_eval: handing the step to the device
#     read          waiting for the previous step's tokens (device time not hidden)
#     postprocess   detokenizing, stop strings, events to clients, request ends
#     memory        the per-step memory sample
#
# Totals only grow; a reader takes differences between two scrapes.

PHASES = ("schedule", "prefill", "decode_graph", "sample_graph", "submit", "read",
          "postprocess", "memory")


class StepClock:
    """Seconds spent per phase, and steps counted (engine thread writes, any thread reads)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._mark = time.perf_counter()

    def start(self) -> None:
        """Begin timing from now (the first phase of a step starts here)."""
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last mark to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._mark
        self._mark = now

    def totals(self) -> tuple[int, dict[str, float]]:
        """Steps so far and a copy of the per-phase seconds."""
        return self.steps, dict(self.seconds)
