"""The process's open-file limit: every connection holds a file descriptor.

Two things get in the way of a server that should hold ``server.max_connections``
sockets:

- the soft ``RLIMIT_NOFILE`` is often far below the hard one (1,024 by
  default on many systems): :func:`raise_open_file_limit` lifts it to the
  hard limit at start;
- importing ``mlx_lm.utils`` sets the limit to exactly ``(2048, 4096)`` (for
  models with many files): it lowers a higher soft limit, lowers the hard
  limit for good in an unprivileged process, and fails the import outright
  where the hard limit is under 4,096. :func:`import_mlx_lm` imports it with
  that one call suppressed, before anything else imports it.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("veloxquant.server")

# File descriptors the process needs besides its connections (model files, logs, the
# listener, the event loop's own).
RESERVED_FDS = 64


def import_mlx_lm() -> None:
    """Import ``mlx_lm`` without letting it change ``RLIMIT_NOFILE``.

    Call once at start-up, on the main thread, before any other import of
    mlx_lm (later imports find the module cached and run nothing).
    """
    real = resource.setrlimit

    def keep_file_limit(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            real(which, limits)

    resource.setrlimit = keep_file_limit
    try:
        import mlx_lm.utils  # noqa: F401
    finally:
        resource.setrlimit = real


def raise_open_file_limit(max_connections: int) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; warn when it is still too low.

    Returns:
        The soft limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-file limit to %s: %s", target, exc)
    if soft < max_connections + RESERVED_FDS:
        log.warning("open-file limit %d is below server.max_connections=%d + %d for the "
                    "process itself: raise `ulimit -n` or lower server.max_connections",
                    soft, max_connections, RESERVED_FDS)
    return soft
