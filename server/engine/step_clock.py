"""Where the engine thread's time goes, phase by phase (read on ``/metrics``).

A decode step on a GPU is bound by host work, not by the device: building
the model's graph, launching it, reading the tokens, detokenizing and
handing events to the clients. The clock splits each step into phases with
one ``perf_counter`` call per phase boundary (well under a microsecond), so
it stays on in production and ``/metrics`` answers "where does a step's time
go?" under the real load::

    schedule      expiry, admission, cancellations
    prefill       prefill model calls (graph, chunk submits, first tokens)
    decode_graph  the batched decode's model graph, paged-KV bookkeeping included
    sample_graph  the sampling graph of that decode
    submit        async_eval: handing the step to the device
    read          waiting for the previous step's tokens (device time not hidden)
    postprocess   detokenizing, stop strings, events to clients, request ends
    memory        the per-step memory sample

Totals only grow; a reader takes differences between two scrapes.
"""

from __future__ import annotations

import time

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
