"""A fake engine for route tests: same interface as server.engine.engine.Engine, no model.

It answers each submitted request from a script chosen by the prompt text,
on a real (tiny) block pool so pool-facing routes see real numbers.
"""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace
from typing import Any

from server.metrics import ServerMetrics
from server.protocol import (
    Admitted,
    ChatPrompt,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    TokenEvent,
    Usage,
)
from server.refusal import Reason, Rejected, Why
from server.text.chat_render import tool_call_format
from server.text.think_tags import (
    opens_thinking,
    think_tags,
)
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig


class FakeEngine:
    """Scripted engine: tokens "Hello", " world" unless the prompt asks otherwise.

    Prompt keywords: ``REJECT429``, ``REJECT400``, ``FAIL`` (model error after
    one token), ``SILENT`` (admitted, then never answers: for disconnect tests),
    ``SCRIPT:`` (the rest of the prompt is the answer, sent 3 characters per
    token, finishing with ``stop``), ``SCRIPTCUT:`` (the same, finishing with
    ``length``: max_tokens cut it).
    """

    def __init__(self, ready: bool = True) -> None:
        self.pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=32))
        self.metrics = ServerMetrics()
        self.is_ready = ready
        self.model_name = "fake-model"
        self.chat_template: str | None = None  # what tool_call_format reads, as a model's
        self.served_names = ("fake-model",)
        self.load_error = None if ready else "boom"
        self.submitted: list[GenerationRequest] = []
        self.live: dict[int, str] = {}
        self.started = False

    @property
    def tool_call_format(self) -> str:
        return tool_call_format(SimpleNamespace(chat_template=self.chat_template))

    def thinking(self, template_kwargs: tuple = ()) -> Any:
        """As the engine's: the think tags of ``loaded.tokenizer``, where a test sets one."""
        tokenizer = getattr(getattr(self, "loaded", None), "tokenizer", None)
        tags = think_tags(tokenizer) if tokenizer is not None else None
        return None if tags is None else (tags, opens_thinking(tokenizer, tags,
                                                               template_kwargs))

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.started = False

    def wait_ready(self, timeout: float | None = None) -> bool:
        return True

    def queue_depths(self) -> tuple[int, int]:
        return 0, 0

    def live_requests(self) -> dict[int, str]:
        return dict(self.live)

    degraded = None

    def shrink(self, stream: str, target_free: int,
               force: bool = False) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        streams = self.pool.config.streams if stream == "kv" else (stream,)
        future.set_result((sum(self.pool.shrink(s, target_free) for s in streams),
                           dict.fromkeys(streams, target_free)))
        return future

    def submit(self, request: GenerationRequest) -> None:
        self.submitted.append(request)
        prompt = request.prompt
        text = prompt if isinstance(prompt, str) else (
            " ".join(m["content"] for m in prompt.messages)
            if isinstance(prompt, ChatPrompt) else "")
        put = request.channel.put
        if "REJECT429" in text:
            put(Rejected(Why.QUEUE_FULL, {"waiting": 1, "max_queue": 1}))
            return
        if "REJECT400" in text:
            put(Rejected(Why.NO_ROOM_IN_POOL, {"tokens": 3, "pool_tokens": 3}, "max_tokens"))
            return
        put(Admitted(owner=1, prompt_tokens=3, reserved_blocks=2))
        if "SILENT" in text:
            return
        for mark, reason in (("SCRIPT:", FinishReason.STOP), ("SCRIPTCUT:", FinishReason.LENGTH)):
            if mark in text:
                script = text.split(mark, 1)[1]
                pieces = [script[i:i + 3] for i in range(0, len(script), 3)]
                for k, piece in enumerate(pieces):
                    put(TokenEvent(piece, k))
                put(Finished(reason, Usage(3, len(pieces), 2)))
                return
        put(TokenEvent("Hello", 1))
        if "FAIL" in text:
            put(Failed(Reason.MODEL_ERROR, "RuntimeError: injected", Usage(3, 1, 2)))
            return
        put(TokenEvent(" world", 2))
        put(Finished(FinishReason.LENGTH, Usage(3, 2, 2)))

    def last_params(self) -> Any:
        return self.submitted[-1].params
