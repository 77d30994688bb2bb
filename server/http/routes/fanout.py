"""Several engine requests answering one HTTP request: ``n`` choices and batch prompts.

Each choice is its own generation (owner, blocks, sampler), submitted
together and merged here::

    choice j = prompt p x n + i  ->  GenerationCall j   (seed + i when seeded)
    start():   all admitted, or the first refusal answers and the rest are cancelled
               (with prefix caching, each prompt's first choice is prefilled first and
               the other n - 1 start on its cached blocks)
    collect(): every outcome, in choice order                      (JSON answers)
    events():  (j, event) pairs as they come, interleaved          (SSE answers)

Whatever ends the answer early (client gone, one choice failing, the route
cancelled) cancels every one of the engine requests, so each frees its blocks
at the engine's next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from server.http.routes.call import GenerationCall, Outcome
from server.protocol import (
    ChoiceGroup,
    Finished,
    TokenEvent,
    Usage,
)

_END = object()  # a pump's last item: its call has no more events


def _retrieve(task: asyncio.Task) -> None:
    # A sibling that failed after the first failure: its exception is known and dropped.
    if not task.cancelled():
        task.exception()


class Fanout:
    """The generations of one HTTP request (possibly none: ``echo`` with ``max_tokens: 0``).

    Args:
        calls: One call per choice, in choice order.
        share_prefill: Choices per prompt that share its prefill through the
            prefix cache (``n`` when prefix caching is on, else 1): the first
            choice of each prompt is prefilled before the others are submitted,
            so they start on its cached blocks instead of computing the prompt
            again. The others' first token comes one prefill later; the
            prompt's compute is paid once instead of ``n`` times.
    """

    def __init__(self, calls: list[GenerationCall], share_prefill: int = 1) -> None:
        self.calls = calls
        self.share_prefill = share_prefill
        # Several choices: events (or errors) their pumps queued and events() has not read
        # yet; None while events() is not merging (its ends are not counted: reading past
        # one may wait).
        self._queued: int | None = None

    @property
    def ready(self) -> bool:
        """Whether :meth:`events` has its next pair already (reading it would not wait)."""
        if self._queued is not None:
            return self._queued > 0
        return len(self.calls) == 1 and self.calls[0].ready

    def cancel(self) -> None:
        """Cancel every engine request (idempotent; finished ones are unaffected)."""
        for call in self.calls:
            call.request.cancel()

    async def _all(self, coros: list[Any]) -> list[Any]:
        """Await ``coros`` together; on the first failure cancel the rest and re-raise."""
        if len(coros) == 1:
            return [await coros[0]]
        tasks = [asyncio.ensure_future(c) for c in coros]
        for task in tasks:
            task.add_done_callback(_retrieve)
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            self.cancel()
            raise

    async def start(self) -> None:
        """Submit every call and wait until all are admitted.

        Raises:
            APIError: One was refused (the others are cancelled).
            ClientGone: The client left while waiting.
        """
        if not self.calls:
            return
        if self.share_prefill <= 1:
            await self._all([call.start() for call in self.calls])
            return
        leaders = self.calls[::self.share_prefill]
        await self._all([self._lead(call) for call in leaders])
        await self._all([call.start() for call in self.calls if call not in leaders])

    async def _lead(self, call: GenerationCall) -> None:
        await call.start()
        await call.prefilled()

    async def collect(self) -> list[Outcome]:
        """Run every call to its end; outcomes in choice order."""
        if not self.calls:
            return []
        return await self._all([call.collect() for call in self.calls])

    async def events(self) -> AsyncIterator[tuple[int, TokenEvent | Finished]]:
        """``(choice, event)`` pairs, interleaved as the engine produces them.

        Raises:
            APIError: A choice failed (the others are cancelled).
            ClientGone: The client left.
        """
        if len(self.calls) <= 1:
            for call in self.calls:  # one choice: no pump task needed
                async for event in call.events():
                    yield 0, event
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._queued = 0

        def put(item: tuple[int, Any]) -> None:
            self._queued += 1
            queue.put_nowait(item)

        async def pump(j: int, call: GenerationCall) -> None:
            try:
                async for event in call.events():
                    put((j, event))
            except Exception as exc:  # ClientGone or APIError: raised to the reader
                put((j, exc))
            finally:
                queue.put_nowait((j, _END))

        tasks = [asyncio.ensure_future(pump(j, call)) for j, call in enumerate(self.calls)]
        try:
            live = len(tasks)
            while live:
                j, item = await queue.get()
                if item is _END:
                    live -= 1
                    continue
                self._queued -= 1
                if isinstance(item, Exception):
                    raise item
                yield j, item
        finally:
            self._queued = None
            for task in tasks:
                task.cancel()
            self.cancel()


def choice_group(group: ChoiceGroup, calls: list[GenerationCall]) -> list[GenerationCall]:
    """``calls`` (one prompt's choices), their requests made the members of ``group``,
    which the scheduler admits together or not at all (server.engine.request_state)."""
    group.members = [call.request for call in calls]
    return calls


def shared_prefill(n: int, settings: Any) -> int:
    """Choices per prompt that share one prefill: ``n`` with prefix caching on, else 1."""
    return n if n > 1 and settings.cache.prefix_caching else 1


class UsageTotal:
    """The ``usage`` of a multi-choice answer.

    Prompt tokens count once per distinct prompt (n choices share it), and so
    do its cached tokens (the most any of its choices reused);
    completion tokens and KV blocks add up over every choice.
    """

    def __init__(self) -> None:
        self._prompts: dict[int, int] = {}
        self._cached: dict[int, int] = {}
        self.completion_tokens = 0
        self.kv_blocks = 0

    def add(self, prompt_index: int, usage: Usage) -> None:
        """Account a finished choice of prompt ``prompt_index``."""
        self._prompts[prompt_index] = usage.prompt_tokens
        self._cached[prompt_index] = max(self._cached.get(prompt_index, 0),
                                         usage.cached_tokens)
        self.completion_tokens += usage.completion_tokens
        self.kv_blocks += usage.kv_blocks

    def add_prompt(self, prompt_index: int, prompt_tokens: int) -> None:
        """Account a prompt that was only scored (``echo`` with ``max_tokens: 0``)."""
        self._prompts[prompt_index] = prompt_tokens

    def as_dict(self) -> dict[str, int]:
        """OpenAI ``usage`` plus our ``kv_blocks``."""
        return Usage(sum(self._prompts.values()), self.completion_tokens,
                     self.kv_blocks, sum(self._cached.values())).as_dict()
