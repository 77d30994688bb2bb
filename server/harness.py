"""The server's model runner without HTTP or the engine thread: what benchmarks drive.

A benchmark of the decode step, of write-back or of a model family wants the code a
served request runs (the runner, the pool's KV arena, write-back, compiled decode),
without the queue, admission or a client. :class:`RunnerHarness` builds those
parts as the server does and offers the moves a measurement makes, in the order a
request goes through them::

    harness = RunnerHarness.for_model(model, n_blocks=4096)   # or .served(settings)
    harness.start({1: prompt_a, 2: prompt_b}, params)        # rows; no model work yet
    first = harness.prefill()                                 # every prompt in
    out = harness.decode()                                    # one batched step
    harness.finish([1, 2])                                    # their blocks go back
    harness.close()

Its names and behaviour are the benchmarks' contract: the engine's modules may
move and split behind it (tests/engine/test_harness.py holds it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from server.engine.run_output import RunOutput, Sampled, StepClock
from server.engine.runner import ModelRunner
from server.engine.startup import assemble, make_pool
from server.metrics import ServerMetrics
from server.model_loader import LoadedModel, load_model
from server.protocol import SamplingParams
from server.settings import Settings
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout


class RunnerHarness:
    """One model runner over its own pool, driven a step at a time (see the module docstring).

    Args:
        runner: The runner.
        loaded: The loaded model when the harness loaded it (it owns the model's
            quantized codes: kept alive as long as the runner runs).
        on_close: What else :meth:`close` ends (a served build's prompt workers).
    """

    def __init__(self, runner: ModelRunner, loaded: LoadedModel | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        self._runner = runner
        self.loaded = loaded
        self._on_close = on_close

    @classmethod
    def for_model(cls, model: Any, n_blocks: int, *, block_size: int = 16,
                  prefill_chunk: int = 512, kv_write_back: int = 1,
                  compile_decode: bool = False, loaded: LoadedModel | None = None,
                  clock: StepClock | None = None,
                  first_tokens_at_once: bool = False) -> RunnerHarness:
        """A runner on ``model`` (an mlx-lm model) over a fresh pool of ``n_blocks`` blocks,
        its KV in the model's native dtype."""
        pool = BlockPoolAllocator(PoolConfig(block_size=block_size, n_blocks=n_blocks))
        runner = ModelRunner(model, pool, prefill_chunk, KVArena(pool, probe_kv_layout(model)),
                             clock or StepClock(), kv_write_back=kv_write_back,
                             compile_decode=compile_decode,
                             first_tokens_at_once=first_tokens_at_once)
        return cls(runner, loaded)

    @classmethod
    def for_settings(cls, settings: Settings, n_blocks: int) -> RunnerHarness:
        """The model ``settings`` name, loaded as the server loads it, with the settings'
        write-back and compiled decode, over a pool of ``n_blocks`` blocks."""
        loaded = load_model(settings.model)
        batch = settings.batch
        return cls.for_model(loaded.model, n_blocks, prefill_chunk=batch.prefill_chunk_size,
                             kv_write_back=batch.kv_write_back,
                             compile_decode=batch.compile_decode, loaded=loaded)

    @classmethod
    def served(cls, settings: Settings) -> RunnerHarness:
        """The runner exactly as the server builds it from ``settings`` (the load's checks,
        the pool sized by ``[pool]``, the KV format, prefix caching)."""
        parts = assemble(settings, make_pool(settings), load_model, ServerMetrics(),
                         StepClock(), lambda *_: None)
        return cls(parts.runner, parts.loaded, parts.preparer.close)

    @property
    def model(self) -> Any:
        return self._runner.model

    @property
    def pool(self) -> BlockPoolAllocator:
        return self._runner.pool

    @property
    def arena(self) -> KVArena:
        """The KV arena (``arena.writes`` counts its writes, ``arena.nbytes`` its size)."""
        return self._runner.arena

    @property
    def clock(self) -> StepClock:
        """Where the runner times its phases."""
        return self._runner.clock

    @property
    def compiled_blocks(self) -> int:
        """Blocks whose decode calls run compiled (0: none)."""
        return self._runner.compiled_blocks

    def start(self, prompts: Mapping[int, Sequence[int]], params: SamplingParams) -> None:
        """Rows for ``prompts`` (owner -> prompt token ids); nothing runs until :meth:`prefill`."""
        for owner, ids in prompts.items():
            self._runner.add(owner, list(ids), params)

    def prefill(self, budget: int = 1 << 20) -> RunOutput:
        """Run prefill calls, ``budget`` prompt tokens each at most, until every started
        prompt is in. The first tokens come with it when no row was decoding before or the
        runner reads them at once (the served build on a CPU); else with the next
        :meth:`decode`, which hides the wait behind its call.

        Returns:
            Every call's output, together (rows that failed, finished tasks).
        """
        out = RunOutput()
        while self._runner.prompts_pending:
            done = self._runner.prefill(budget)
            out.tokens += done.tokens
            out.failed += done.failed
            out.tasks_done += done.tasks_done
        return out

    def decode(self) -> RunOutput:
        """One batched decode step over every prefilled row."""
        return self._runner.decode()

    def generate(self, prompts: Mapping[int, Sequence[int]], params: SamplingParams, n: int,
                 budget: int = 1 << 20) -> dict[int, list[Sampled]]:
        """Start ``prompts``, prefill them and decode until every row has ``n`` tokens (at
        most ``n + 1`` decodes after the prefill); each row's tokens in order. The rows
        stay in the runner (:meth:`finish` them).

        Raises:
            RuntimeError: A row failed, or some row had fewer than ``n`` tokens by then.
        """
        self.start(prompts, params)
        got: dict[int, list[Sampled]] = {owner: [] for owner in prompts}
        out = self.prefill(budget)
        for _ in range(n + 2):  # the prefill's output, then each decode's
            if out.failed or out.call_error is not None:
                raise RuntimeError(f"the runner failed: {out.call_error or out.failed}")
            for sampled in out.tokens:
                got[sampled.owner].append(sampled)
            if all(len(tokens) >= n for tokens in got.values()):
                return got
            out = self.decode()
        raise RuntimeError(f"a prefill and {n + 1} decodes gave "
                           f"{[len(tokens) for tokens in got.values()]} tokens, not {n}")

    def finish(self, owners: Iterable[int]) -> dict[int, int]:
        """Rows leave; their blocks go back to the pool. Returns owner -> blocks it held."""
        return self._runner.remove(owners)

    def close(self) -> None:
        """Wait for model work in flight; end what the build started."""
        self._runner.close()
        if self._on_close is not None:
            self._on_close()

    def __enter__(self) -> RunnerHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
