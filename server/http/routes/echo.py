"""Completions ``echo``: the prompt as sent and, with ``logprobs``, its tokens' log-probabilities.

Scoring a prompt is model work, so it runs on the engine thread, one chunk
per :meth:`Engine.run_on_engine` call (running requests decode in between);
tokenizing it runs on a worker thread (server.engine.scoring). The route
waits the way a generation does: it stops when the request's client watch
says the client left (woken at once), and checks every ``ENGINE_CHECK_S`` that the
engine is alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import Request

from server.engine.protocol import Rejected
from server.http.client_watch import client_watch
from server.http.errors import GenerationError, UnavailableError, engine_error
from server.http.routes.call import ENGINE_CHECK_S, ClientGone


async def _on_engine(http_request: Request, engine: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the engine thread and await it, watching the client and the engine."""
    watch = client_watch(http_request.scope)
    watch.listen(http_request.receive)
    future = asyncio.wrap_future(engine.run_on_engine(fn))
    gone = asyncio.get_running_loop().create_future()  # the client leaving ends a wait
    watch.on_gone(lambda: gone.done() or gone.set_result(None))
    while True:
        await asyncio.wait({future, gone}, timeout=ENGINE_CHECK_S,
                           return_when=asyncio.FIRST_COMPLETED)
        if future.done():
            break
        if watch.gone:
            raise ClientGone()  # the chunk in progress ends on its own; the job is dropped
        if not engine.is_ready:
            raise UnavailableError("the generation engine stopped")
    try:
        return future.result()
    except Exception as exc:
        if not engine.is_ready:
            raise UnavailableError("the generation engine stopped") from None
        raise GenerationError(f"scoring the prompt failed: {type(exc).__name__}: {exc}",
                              code="generation_failed") from None


async def score_prompts(http_request: Request, engine: Any, prompts: list[str | list[int]],
                        top_n: int | None) -> list[Any]:
    """One scoring job per prompt, each run to its end.

    Args:
        http_request: For disconnect polling.
        engine: The engine.
        prompts: Prompt texts or token ids.
        top_n: Alternatives per token (``logprobs``), or None: no scoring, only
            tokenizing (the echoed text and the prompt's token count).

    Raises:
        APIError: A prompt is refused (empty, too long, bad ids) or scoring failed.
        ClientGone: The client left.
    """
    jobs = []
    for prompt in prompts:
        job = await asyncio.to_thread(engine.prompt_scorer, prompt, top_n)
        if isinstance(job, Rejected):
            raise engine_error(job)
        while not job.done:
            await _on_engine(http_request, engine, job.step)
        jobs.append(job)
    return jobs
