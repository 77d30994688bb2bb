"""The model runner: prefill and batched decode over pool-held KV (engine thread only).

It speaks in owner ids, token ids and sampling parameters; it knows nothing
of text, stop strings or clients (that is :class:`server.engine.steps.OutputProcessor`).

Every running request is a :class:`~server.engine.prefill.Row`. A row first
*prefills*: with the requests that start in the same step it forms a
:class:`~server.engine.prefill.PrefillGroup` whose prompts run through the
model together, in chunks, into a multi-row paged batch (blocks under each
request's own owner; keys and values in the pool's KV arena). Each row's
first token is sampled (lazily) as soon as its group's prompts are in; the
group then *joins* the decode batch at the step boundary, the first token is
its rows' first decode input, and it is read with that decode's tokens, so
prefill never makes the host wait for the device while rows decode. With no
row decoding there is nothing to overlap: the first tokens are read as the
prefill ends, so they reach the clients a step sooner (and a request whose
first token is its last runs no decode at all).
Each :meth:`ModelRunner.decode` decodes every joined row in ONE model call,
reading the tokens of step ``k`` while step ``k+1`` computes, as mlx-lm's
``generate_step`` does for one stream (when every row's token read now is its
``max_tokens``-th, no model call follows it); rows with a grammar (``response_format``)
decode in the same call, their logits masked first. Each row samples with its
own settings (:mod:`server.engine.sampling`). The step's order, with and without
constrained rows, is drawn in docs/design/batching.md ("Decode").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx

from server.engine.kv_memory import PrefixHit, PromptPrefixes
from server.engine.prefill import PrefillGroup, Row, join_groups, sliced_chunk
from server.engine.run_output import RowFailure, RowHook, RunOutput, Sampled, StepClock, TaskDone
from server.engine.sampling import (
    SamplingPlan,
    ban,
    constrain,
    sample_rows,
)
from server.protocol import SamplingParams
from veloxquant_mlx.compiled_decode import compile_decode_blocks
from veloxquant_mlx.memory import BlockPoolAllocator
from veloxquant_mlx.memory.kv_arena import KVArena
from veloxquant_mlx.memory.paged_batch import PagedKVBatch
from veloxquant_mlx.memory.pooled_caches import caches_over

log = logging.getLogger("veloxquant.server")


class ModelRunner:
    """Prefilling rows, joining rows and the decode batch.

    Args:
        model: The mlx-lm model.
        pool: The shared pool the rows' blocks come from.
        prefill_chunk_size: Most prompt columns per prefill model call.
        arena: The pool's KV arena (where the blocks' keys and values live).
        clock: Where the decode's phases are timed (see :mod:`server.engine.run_output`).
        kv_write_back: Decode columns the batch holds out of the arena before
            one write of them all (:mod:`veloxquant_mlx.memory.write_back`); 1
            writes every step.
        compile_decode: Run the decode calls of the model's own Llama-shaped
            blocks (:mod:`veloxquant_mlx.llama_model`) as compiled halves
            (:mod:`veloxquant_mlx.compiled_decode`).
        fuse_projections: With ``compile_decode``, run each block's q/k/v and
            gate/up projections as one matmul each.
        first_tokens_at_once: A prefill reads its rows' first tokens itself even
            while other rows decode (see :meth:`prefill`): right on a CPU, where
            nothing overlaps the wait; on a GPU it would leave the device idle.
    """

    def __init__(self, model: Any, pool: BlockPoolAllocator, prefill_chunk_size: int,
                 arena: KVArena, clock: StepClock | None = None,
                 prefixes: PromptPrefixes | None = None, kv_write_back: int = 1,
                 compile_decode: bool = False, fuse_projections: bool = True,
                 first_tokens_at_once: bool = False) -> None:
        self.model = model
        self.first_tokens_at_once = first_tokens_at_once
        # Blocks whose decode calls run compiled (0: off, or no Llama-shaped block).
        self.compiled_blocks = (compile_decode_blocks(model, fuse_projections)
                                if compile_decode else 0)
        self.kv_write_back = kv_write_back
        self.prefixes = prefixes  # prefix caching: prefilled prompts publish their blocks
        self.pool = pool
        self.arena = arena
        self.chunk = prefill_chunk_size
        self.prefilling: list[Row] = []  # added, prefill not started
        self.group: PrefillGroup | None = None  # prefill in progress
        self.joining: list[PrefillGroup] = []  # prefilled, joining at the next decode
        self.rows: list[Row] = []
        self.batch: PagedKVBatch | None = None  # the decode batch
        self.inputs: mx.array | None = None
        self._solo: set[int] = set()  # owners that prefill alone (see PrefillGroup.form)
        self._plan: SamplingPlan | None = None  # how the decode rows sample (rows change: None)
        self._refused: list[tuple[int, Exception]] = []  # owners whose grammar refused a token
        self.clock = clock or StepClock()
        # Every token a row feeds passes through here (lazily): the identity, except
        # on a model split over ranks, where it hands every rank rank 0's tokens
        # (server.distributed.token_sharer).
        self.share_tokens: Callable[[mx.array], mx.array] = _same
        # Before a decode hands its graph to the device (the engine thread then waits
        # without the GIL: the event loop's moment to stream the last step's tokens).
        self.before_submit: Callable[[], None] = _nothing
        # Before each prefill chunk: a client that hung up stops its prefill there.
        self.before_chunk: Callable[[], None] = _nothing
        # Prompt tokens a second that recent prefill chunks ran at (None: not measured
        # yet); sizes the chunks of a time-sliced prefill (see prefill()). A scoring
        # group keeps its own (PrefillGroup.rate).
        self.prefill_rate: float | None = None

    # -- rows in and out -------------------------------------------------------

    def add(self, owner: int, prompt_ids: list[int], params: SamplingParams,
            prefix: PrefixHit | None = None, task: Any = None) -> None:
        """Queue a request for prefill (no model work yet).

        ``prefix``: the cached blocks it starts on (acquired at admission) and
        its prompt's block keys, when prefix caching is on. ``task``: a whole-prompt
        task (:class:`~server.engine.prefill.Row`), or None to generate.
        """
        # Its KV: the request's block table in the pool's storage, under its owner.
        row = Row.start(owner, prompt_ids, params, prefix, task, caches_over(self.arena, owner))
        self.prefilling.append(row)

    def remove(self, owners: Iterable[int]) -> dict[int, int]:
        """Take rows out wherever they are; their blocks of every layer go back now.

        Owners the runner does not hold are ignored, so removing twice is harmless.

        Returns:
            Owner -> blocks it held just before leaving.
        """
        gone = set(owners)
        held = {owner: self.pool.n_blocks_held(owner) for owner in gone}
        leaving = [r for r in self.held_rows() if r.owner in gone]
        self._solo -= gone
        self.prefilling = [r for r in self.prefilling if r.owner not in gone]
        for group in self._groups():
            group.drop(gone)
        if self.group is not None and not self.group.rows:
            self.group = None
        self.joining = [g for g in self.joining if g.rows]
        keep = [i for i, r in enumerate(self.rows) if r.owner not in gone]
        if len(keep) < len(self.rows):
            self._filter(keep)
        for row in leaving:  # out of every batch: closing its caches retires the owner
            row.kv[0].release()
        return held

    @property
    def prompts_pending(self) -> bool:
        """Some row's prompt is not all in yet (waiting for prefill, or prefilling)."""
        return bool(self.prefilling) or self.group is not None

    def held_rows(self) -> list[Row]:
        """Every row the runner holds: prefilling, in prefill groups, decoding."""
        return self.prefilling + [r for g in self._groups() for r in g.rows] + self.rows

    def _groups(self) -> list[PrefillGroup]:
        """The prefill group running now (if any), then those waiting to join decode."""
        return ([self.group] if self.group else []) + self.joining

    def _filter(self, keep: list[int]) -> None:
        """Keep decode rows ``keep``; the others' blocks go back to the pool."""
        self.rows = [self.rows[i] for i in keep]
        self._plan = None
        self.batch.filter(keep)
        if not keep:
            self.batch.close()
            self.batch, self.inputs = None, None
            return
        self.inputs = self.inputs[mx.array(keep, dtype=mx.int32)]

    def close(self) -> None:
        """Wait for model work in flight (the last decode's lookahead): the engine stops."""
        mx.synchronize()

    # -- prefill -----------------------------------------------------------------

    def prefill(self, budget: int, hook: RowHook | None = None,
                seconds: float | None = None) -> RunOutput:
        """Prefill within ``budget`` prompt tokens; sample each finished group's first tokens.

        With ``seconds``, while rows decode or wait to join (they wait for this
        step's prefill), the step's prefill keeps to about that many seconds: each
        chunk is cut to what ran in the time left before (:attr:`prefill_rate`),
        and none starts once less than half the slice is left.
        On a CPU a chunk runs as it is handed over, so this bounds their stall
        (the engine passes no ``seconds`` on a GPU, where chunks are queued and
        the token budget bounds it). The rest goes on next step.

        An error in a group's model call restarts its rows alone (nothing was
        handed back for them yet); a lone row whose call raises fails.
        """
        out = RunOutput()
        left = budget
        deadline = None if seconds is None else time.monotonic() + seconds
        time_left, ran = seconds, False
        while left > 0:
            self.before_chunk()  # may remove rows, the whole group's included
            if self.group is None and not self.prefilling:
                break
            if deadline is not None and ran and (self.rows or self.joining):
                time_left = deadline - time.monotonic()
                if time_left < seconds / 2:  # the slice is spent: the rest next step
                    break
            if self.group is None:
                self.group = PrefillGroup.form(self.prefilling, self.model, self.arena,
                                               budget, self._solo)
            group = self.group
            self._run_hooks(group.rows, hook, out)
            if self.group is None:
                continue  # every row of the group failed in its hook
            try:
                started = time.monotonic()
                used, logits = group.advance(self.model, self._chunk_for(group, time_left),
                                             left)
                if logits is None and used:  # a chunk before the last has run: timed
                    self._measure(group, used, time.monotonic() - started)
                elif logits is not None:
                    group.first_tokens(logits, self.share_tokens)
            except Exception as exc:
                out.call_error = exc
                self._prefill_failed(group, exc, out)
                continue
            out.calls_ran += 1
            left -= max(used, 1)
            ran = True
            task = group.rows[0].task
            if task is not None and task.done:
                self._task_done(group, out)
            elif logits is not None:
                self.group = None
                self.joining.append(group)
                self._publish(group)
        if self.joining and (self.first_tokens_at_once or not self.rows):
            self._read_first_tokens(out)
        return out

    def _read_first_tokens(self, out: RunOutput) -> None:
        """Hand back the joining rows' first tokens now: nothing decodes (no step to hide
        the wait behind), or the runner reads them at once (a CPU, where the next decode
        would only make the clients wait its whole call for them). They stay the rows'
        first decode inputs, no longer pending.
        A row with a grammar keeps its own pending: its grammar checks each token
        before the client gets it, in the decode that feeds it."""
        rows = [row for group in self.joining for row in group.rows
                if row.pending and row.matcher is None]
        if not rows:
            return
        out.tokens += _handed_back(rows, mx.concatenate([row.first for row in rows]).tolist())

    def _task_done(self, group: PrefillGroup, out: RunOutput) -> None:
        """A row's whole-prompt task is done: it leaves now, its blocks back in the pool."""
        owner = group.rows[0].owner
        held = self.pool.n_blocks_held(owner)
        group.batch.close()
        group.rows[0].kv[0].release()
        self.group = None
        self._solo.discard(owner)
        out.tasks_done.append(TaskDone(owner, group.rows[0].task, held))

    def _chunk_for(self, group: PrefillGroup, seconds: float | None) -> int:
        """Columns of the group's next chunk (:func:`~server.engine.prefill.sliced_chunk`
        while rows wait for a time-sliced prefill)."""
        if seconds is None or not (self.rows or self.joining):
            return self.chunk
        return sliced_chunk(group, self.chunk, self.prefill_rate, seconds)

    def _measure(self, group: PrefillGroup, tokens: int, elapsed: float) -> None:
        rate = tokens / max(elapsed, 1e-6)
        if group.rows[0].task is not None:
            group.rate = rate  # its last chunk, at the depth nearest the next one's
            return
        old = self.prefill_rate
        self.prefill_rate = rate if old is None else (old + rate) / 2

    def publish_outputs(self, owners: set[int]) -> int:
        """Hand the full blocks of decode rows ``owners`` (prompt and output) to the cache
        as they finish, before they leave (:meth:`PromptPrefixes.publish_ending`);
        returns positions published."""
        if self.prefixes is None or self.batch is None:
            return 0
        return self.prefixes.publish_ending(self.rows, self.batch, owners)

    def _publish(self, group: PrefillGroup) -> None:
        """Hand the group's computed full prompt blocks to the prefix cache.

        Their KV is written once this step's model work runs (MLX orders the
        arena's updates), before any later request can read them.
        """
        if self.prefixes is None:
            return
        try:  # an optimisation: a fault here must not fail the prefilled rows
            self.prefixes.publish_rows(group.rows, group.batch.rows)
        except Exception:
            log.exception("caching the prompt blocks of a prefill group failed")

    def _run_hooks(self, rows: list[Row], hook: RowHook | None, out: RunOutput) -> None:
        if hook is None:
            return
        for row in list(rows):
            try:
                hook(row.owner)
            except Exception as exc:
                self._fail([row.owner], exc, out)

    def _prefill_failed(self, group: PrefillGroup, exc: Exception, out: RunOutput) -> None:
        """A lone row fails; a group's rows restart their prefill alone."""
        if len(group.rows) == 1:
            self._fail([group.rows[0].owner], exc, out)
            return
        group.batch.close()
        self._solo.update(r.owner for r in group.rows)
        self.prefilling[:0] = group.rows
        self.group = None

    def _fail(self, owners: list[int], exc: Exception, out: RunOutput) -> None:
        held = self.remove(owners)
        out.failed += [RowFailure(owner, exc, held[owner]) for owner in owners]

    # -- decode ------------------------------------------------------------------

    def decode(self, hook: RowHook | None = None) -> RunOutput:
        """Join prefilled groups, then decode every row in one model call.

        An error in that call fails every row in it.
        """
        out = RunOutput()
        self._run_hooks(self.rows + [r for g in self.joining for r in g.rows], hook, out)
        out.rows = len(self.rows) + sum(len(g.rows) for g in self.joining)
        try:
            out.tokens, called = self._decode_step()
            out.calls_ran = int(called)
            if not called:  # a read without a model call is no decode step
                out.rows = 0
        except Exception as exc:
            self._refused = []  # failing with every row of the call
            out.call_error = exc
            self._fail([row.owner for row in self.rows], exc, out)
            out.rows = 0
        refused, self._refused = self._refused, []
        for owner, error in refused:  # a token its grammar refused fails a row alone
            self._fail([owner], error, out)
        return out

    def _join(self) -> None:
        """Move prefilled groups into the batch (a step boundary)."""
        if self.joining:
            self.batch, self.inputs = join_groups(self.joining, self.batch, self.inputs,
                                                  self.kv_write_back)
            self.rows += [row for group in self.joining for row in group.rows]
            self._plan = None
            self.joining = []

    def _decode_step(self) -> tuple[list[Sampled], bool]:
        """One batched model call; returns the tokens that became ready, one per row at
        most, and whether the model was called.

        A batch with constrained rows reads its current tokens before sampling
        (each row's next mask needs its token), after the model call was handed
        to the device, so the masks are computed while the model runs; a batch
        of free rows only reads them after the next tokens were handed over.
        """
        self._join()
        if not self.rows:
            return [], False
        if all(row.pending and row.left == 1 and row.matcher is None for row in self.rows):
            return self._read_last_tokens(), False
        clock = self.clock
        current = self.inputs
        logits = self.model(current[:, None], cache=self.batch.caches)[:, -1, :]
        clock.lap("decode_graph")
        if self._plan is None:
            self._plan = SamplingPlan.of(self.rows)
        plan = self._plan
        if plan.banned is not None:
            logits = ban(logits, *plan.banned)
        tokens = None
        raw = logits
        if plan.masks is not None:
            self.before_submit()
            mx.async_eval(logits, self.arena.data)
            clock.lap("submit")
            tokens = current.tolist()
            clock.lap("read")
            logits, refused = constrain(plan, logits, tokens)
            # a token its grammar refused fails its row alone (after the call)
            self._refused += [(self.rows[i].owner, error) for i, error in refused]
        nxt, logprobs = sample_rows(plan, self.rows, logits, current)
        if plan.masks is not None and plan.logprobs:
            # Constrained rows report the model's own distribution: the masked one
            # holds -inf, which no JSON number can carry.
            raw_lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
            logprobs = mx.where(plan.free[:, None], logprobs, raw_lp)
        clock.lap("sample_graph")
        self.before_submit()  # right before the GIL is let go: see its note in __init__
        # The call's KV writes too. The log-probabilities (an exp per vocabulary
        # entry and row: ~10 ms a step for 16 rows of a 49k vocabulary on this
        # CPU) only when some row hands them back.
        mx.async_eval(nxt, *([logprobs] if plan.logprobs else []), self.arena.data)
        clock.lap("submit")
        if tokens is None:
            tokens = current.tolist()  # the one host sync of a step
            clock.lap("read")
        out = []
        for i, row in enumerate(self.rows):
            if row.pending:
                out.append(Sampled(row.owner, tokens[i], row.logprobs))
                row.left -= 1
            row.pending = True
            if row.fed is not None:  # this call stored it: its output blocks hold it
                row.fed.append(tokens[i])
            if row.want_logprobs:
                row.logprobs = logprobs[i]
        self.inputs = self.share_tokens(nxt)
        return out, True

    def _read_last_tokens(self) -> list[Sampled]:
        """Every row's pending token is its last: read them without a model call (its
        next token would be thrown away). Only rows without a grammar: the decode
        call is where a grammar checks its row's token. A row that goes on all the
        same feeds that token next step, so nothing is lost."""
        tokens = self.inputs.tolist()
        self.clock.lap("read")
        return _handed_back(self.rows, tokens)


def _handed_back(rows: list[Row], tokens: list[int]) -> list[Sampled]:
    """``rows``' pending tokens, read outside a decode call: no longer pending, one fewer
    owed to each."""
    for row in rows:
        row.pending, row.left = False, row.left - 1
    return [Sampled(row.owner, token, row.logprobs)
            for row, token in zip(rows, tokens, strict=True)]


def _same(tokens: mx.array) -> mx.array:
    return tokens


def _nothing() -> None:
    pass
