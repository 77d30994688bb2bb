"""Top-level request fields no endpoint knows: ignored and logged once, or refused.

Front ends send other servers' fields along with OpenAI's (Open WebUI's
``num_ctx`` and ``keep_alive``, Ollama-style ``options``); llama-server, vLLM
and mlx_lm.server ignore them, and so does this server by default
(``server.unknown_fields = "ignore"``). Each new name is logged once at
warning level, so a misspelt field (``temprature``) still shows in the log,
and every one is counted in ``veloxquant_request_unknown_fields_total``.
``"reject"`` answers OpenAI's 400 ``unknown_parameter`` naming the field
instead.

The check is a route dependency over the parsed JSON: FastAPI runs it before
the body is validated, so with ``reject`` the 400 names the unknown field
ahead of any other problem of the body. A field sent as ``null`` counts as
not sent, as everywhere in the request models.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import Request
from pydantic import BaseModel

from server.http.errors import quoted, unrecognized
from server.metrics import ServerMetrics

log = logging.getLogger("veloxquant.server")

# Names remembered as logged: past this many, new names are counted but not logged, so a
# client inventing names grows neither memory nor the log. Each is kept this long at most.
MAX_LOGGED_NAMES = 256
MAX_NAME_CHARS = 80


class UnknownFields:
    """One app's policy for unknown fields, and the names it has logged.

    Used on the event loop only (route dependencies), so it takes no lock.

    Args:
        policy: ``"ignore"`` or ``"reject"`` (``server.unknown_fields``).
        metrics: Where each unknown field is counted.
    """

    def __init__(self, policy: str, metrics: ServerMetrics) -> None:
        self.policy = policy
        self.metrics = metrics
        self._logged: set[str] = set()

    def check(self, names: list[str], endpoint: str) -> None:
        """Count ``names`` (fields ``endpoint`` does not know); refuse or log them.

        Raises:
            InvalidRequestError: With ``reject``: 400 ``unknown_parameter`` naming the first.
        """
        if not names:
            return
        self.metrics.unknown_fields_sent(endpoint, len(names))
        if self.policy == "reject":
            raise unrecognized(names)
        for name in names:
            self._log_once(name, endpoint)

    def _log_once(self, name: str, endpoint: str) -> None:
        """A warning the first time ``name`` is seen, while fewer than the bound were."""
        key = name[:MAX_NAME_CHARS]
        if key in self._logged or len(self._logged) > MAX_LOGGED_NAMES:
            return
        self._logged.add(key)
        if len(self._logged) > MAX_LOGGED_NAMES:
            log.warning("more than %d distinct unknown request fields seen: new ones are "
                        "ignored without a log line (still counted in "
                        "veloxquant_request_unknown_fields_total)", MAX_LOGGED_NAMES)
            return
        log.warning("ignoring request field %s on %s: no field of this endpoint has that "
                    "name (logged once per name; server.unknown_fields = \"reject\" refuses "
                    "it instead)", quoted(name, MAX_NAME_CHARS), endpoint)


def unknown_fields_of(model: type[BaseModel],
                      endpoint: str) -> Callable[[Request], Awaitable[None]]:
    """A route dependency applying ``server.unknown_fields`` to ``model``'s top level.

    ``endpoint`` is the route's path, the metric's label.
    """
    known = frozenset(model.model_fields)

    async def check_unknown_fields(request: Request) -> None:
        body = await json_body(request)
        if isinstance(body, dict):
            names = [key for key, value in body.items()
                     if value is not None and key not in known]
            request.app.state.unknown_fields.check(names, endpoint)

    return check_unknown_fields


async def json_body(request: Request) -> object:
    """The body as parsed JSON (FastAPI parsed it already; Starlette keeps it), else None."""
    try:
        return await request.json()
    except ValueError:  # not JSON: validation says so
        return None
