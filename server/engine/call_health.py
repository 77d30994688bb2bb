"""Whether the model's calls still run: failed calls in a row, for ``/health``.

A model call that raises fails the requests in it, and the engine goes on: most such
errors belong to one call (a batch too large for the device's memory right now). Some
do not go away. On MLX's CUDA backend an error thrown while a step's graph is committed
leaves that stream's command encoder broken, and every later call fails the same way
(ml-explore/mlx#4326) until the process restarts. The server then answered every
request with an error while ``/health`` still said ok, so nothing would restart it.

:class:`CallHealth` counts the model calls that failed since the last one that ran;
from :data:`FAILED_CALLS_UNHEALTHY` on, ``/health`` answers 503 with the last error,
which a supervisor's liveness probe acts on. Requests are still admitted meanwhile:
only a call that runs can show that the device works again, and the first one that
does makes ``/health`` ok again.
"""

from __future__ import annotations

import logging

from server.engine.run_output import RunOutput

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
