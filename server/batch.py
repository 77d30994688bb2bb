"""Continuous batching on the shared pool (engine thread only).

Every running request is a :class:`~server.prefill.Row`. A row first
*prefills*: with the requests that start in the same step it forms a
:class:`~server.prefill.PrefillGroup` whose prompts run through the model
together, in chunks, into multi-row pool-backed caches (blocks under each
request's own owner). Each row's first token is sampled and sent as soon as
its group's prompts are in, so time to first token does not wait for the
decode batch. The group then *joins* the decode batch at the next step
boundary. Each :meth:`DecodeBatch.step` decodes every joined row in ONE
model call::

    step k:   feed  inputs (token t_k of each row)  -> logits -> sample t_k+1 (lazy)
              async_eval(t_k+1)                         # the device starts on step k
              read  t_k (ready since step k-1)  -> detokenize, stop, events
    rows that finished leave (filter): their blocks return to the pool now

Reading ``t_k`` while ``t_k+1`` computes keeps Python's per-token work off
the model's critical path, as mlx-lm's ``generate_step`` does for one
stream. A row's KV never exceeds ``prompt + max_tokens`` tokens (the last
token is fed once before the row is seen to finish), which is what the
admission reservation covers.

Each row samples with its own settings (temperature, top-p/k, min-p, seed,
penalties, logit bias); when every row is greedy with no processors the
whole batch samples with one ``argmax``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from server.generation import TokenEvent
from server.prefill import PrefillGroup, Row
from server.request_state import RequestState
from server.sampling import build_logits_processors, build_sampler, token_logprob
from veloxquant_mlx.memory import BlockPoolAllocator
from veloxquant_mlx.memory.pool_backed_batch import PoolBackedBatchKVCache


@dataclass(frozen=True, slots=True)
class Emitted:
    """A token a step produced for a request (``event`` None: nothing to send)."""

    state: RequestState
    event: TokenEvent | None


@dataclass(slots=True)
class StepOutcome:
    """What one engine step did.

    Attributes:
        emitted: Tokens for the clients (first tokens from prefills, then decoded ones).
        failed: Requests whose model work raised; already out of the batch.
        held: Blocks each removed request held when it left (for its usage record).
        decoded_rows: Rows in the batched decode call (0: no call).
    """

    emitted: list[Emitted] = field(default_factory=list)
    failed: list[tuple[RequestState, Exception]] = field(default_factory=list)
    held: dict[int, int] = field(default_factory=dict)
    decoded_rows: int = 0


class DecodeBatch:
    """Prefilling rows, joining rows and the decode batch of the running requests.

    Args:
        model: The mlx-lm model.
        tokenizer: Its tokenizer (for log-probability texts).
        pool: The shared pool the rows' caches draw from.
        prefill_chunk_size: Most prompt columns per prefill model call.
    """

    def __init__(self, model: Any, tokenizer: Any, pool: BlockPoolAllocator,
                 prefill_chunk_size: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.chunk = prefill_chunk_size
        self.prefilling: list[Row] = []  # admitted, prefill not started
        self.group: PrefillGroup | None = None  # prefill in progress
        self.joining: list[PrefillGroup] = []  # prefilled, joining at the next step
        self.rows: list[Row] = []
        self.caches: list[PoolBackedBatchKVCache] | None = None
        self.inputs: mx.array | None = None
        self._live: set[int] = set()  # owners of every row, wherever it is
        self._solo: set[int] = set()  # owners that prefill alone (see PrefillGroup.form)

    # -- rows in and out -------------------------------------------------------

    def add(self, state: RequestState) -> None:
        """Queue a just-admitted request for prefill (no model work yet)."""
        params = state.request.params
        processors = build_logits_processors(params)
        row = Row(state, build_sampler(params), processors,
                  greedy=params.temperature == 0.0 and not processors)
        if processors:
            row.history = mx.array(state.prompt_ids)
        self.prefilling.append(row)
        self._live.add(state.owner)

    def remove(self, states: Sequence[RequestState]) -> dict[int, int]:
        """Take requests out wherever they are; their blocks of every layer go back now.

        Returns:
            Owner -> blocks it held just before leaving, for the requests found.
        """
        gone = {s.owner for s in states if s.owner in self._live}
        if not gone:
            return {}
        held = {owner: self.pool.n_blocks_held(owner) for owner in gone}
        self._live -= gone
        self._solo -= gone
        self.prefilling = [r for r in self.prefilling if r.state.owner not in gone]
        for group in ([self.group] if self.group else []) + self.joining:
            keep = [i for i, r in enumerate(group.rows) if r.state.owner not in gone]
            if len(keep) < len(group.rows):
                group.keep(keep)
        if self.group is not None and not self.group.rows:
            self.group = None
        self.joining = [g for g in self.joining if g.rows]
        keep = [i for i, r in enumerate(self.rows) if r.state.owner not in gone]
        if len(keep) == len(self.rows):
            return held
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            for cache in self.caches:
                cache.release()
            self.caches, self.inputs = None, None
            return held
        for cache in self.caches:
            cache.filter(keep)
        self.inputs = self.inputs[mx.array(keep, dtype=mx.int32)]
        return held

    def __len__(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Wait for model work still in flight, e.g. the last step's lookahead.

        Called when the engine stops, so no MLX work runs while the process exits.
        """
        mx.synchronize()

    # -- one engine step ---------------------------------------------------------

    def run_step(self, prefill_budget: int,
                 hook: Callable[[RequestState], None] | None = None) -> StepOutcome:
        """Prefill within ``prefill_budget`` prompt tokens, then one batched decode.

        ``hook`` (fault injection) is called per request before its model
        work; a request whose hook raises fails alone, an error in a model
        call fails every row in that call. Failed requests, and requests
        ended by their first token, leave before the outcome is returned.
        """
        out = StepOutcome()
        budget = prefill_budget
        while budget > 0 and (self.group is not None or self.prefilling):
            if self.group is None:
                self.group = PrefillGroup.form(self.prefilling, self.model, self.pool,
                                               prefill_budget, self._solo)
            group = self.group
            self._run_hooks(group.rows, hook, out)
            if self.group is None:
                continue  # every row of the group failed in its hook
            try:
                used, logits = group.advance(self.model, self.chunk, budget)
                first = self._first_tokens(group, logits) if logits is not None else None
            except Exception as exc:
                self._prefill_failed(group, exc, out)
                continue
            budget -= used
            if first is not None:
                self.group = None
                self.joining.append(group)
                out.emitted += first
                ended = [r.state for r in group.rows if r.state.finish is not None]
                out.held.update(self.remove(ended))  # their first token ended them
        self._run_hooks(self.rows + [r for g in self.joining for r in g.rows], hook, out)
        out.decoded_rows = len(self.rows) + sum(len(g.rows) for g in self.joining)
        try:
            out.emitted += self.step()
        except Exception as exc:  # one model call for all rows: all of them fail
            self._fail([row.state for row in self.rows], exc, out)
            out.decoded_rows = 0
        return out

    def _run_hooks(self, rows: list[Row], hook, out: StepOutcome) -> None:
        if hook is None:
            return
        for row in list(rows):
            try:
                hook(row.state)
            except Exception as exc:
                self._fail([row.state], exc, out)

    def _prefill_failed(self, group: PrefillGroup, exc: Exception, out: StepOutcome) -> None:
        """A lone row fails; a group's rows restart their prefill alone (nothing was sent yet)."""
        if len(group.rows) == 1:
            self._fail([group.rows[0].state], exc, out)
            return
        for cache in group.caches:
            cache.release()
        self._solo.update(r.state.owner for r in group.rows)
        self.prefilling[:0] = group.rows
        self.group = None

    def _fail(self, states: list[RequestState], exc: Exception, out: StepOutcome) -> None:
        out.failed += [(state, exc) for state in states]
        out.held.update(self.remove(states))

    def _first_tokens(self, group: PrefillGroup, logits: mx.array) -> list[Emitted]:
        """Sample and account every row's first token (one evaluation for the group)."""
        drawn = [self._sample_one(row, logits[i: i + 1]) for i, row in enumerate(group.rows)]
        mx.eval(drawn)
        tokens = mx.concatenate([token for token, _ in drawn]).tolist()
        out = []
        for row, (token, logprobs), value in zip(group.rows, drawn, tokens, strict=True):
            row.first = token
            out.append(self._accept(row, value, logprobs[0]))
        return out

    def _sample_one(self, row: Row, logits: mx.array) -> tuple[mx.array, mx.array]:
        for processor in row.processors:
            logits = processor(row.history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return row.sampler(logprobs), logprobs

    # -- decode ------------------------------------------------------------------

    def _join(self) -> None:
        """Move prefilled groups into the batch (a step boundary)."""
        for group in self.joining:
            first = mx.concatenate([row.first for row in group.rows])
            if self.caches is None:
                self.caches, self.inputs = group.caches, first
            else:
                for batch_layer, group_layer in zip(self.caches, group.caches, strict=True):
                    batch_layer.extend(group_layer)
                self.inputs = mx.concatenate([self.inputs, first])
            for row in group.rows:
                row.first, row.pending = None, False
            self.rows += group.rows
        self.joining = []

    def step(self) -> list[Emitted]:
        """Join waiting rows, then decode every row in one model call.

        Returns:
            The tokens that became ready for the clients, one per row that had one.
        """
        self._join()
        if not self.rows:
            return []
        current = self.inputs
        logits = self.model(current[:, None], cache=self.caches)[:, -1, :]
        nxt, logprobs = self._sample(logits, current)
        mx.async_eval(nxt, logprobs)
        tokens = current.tolist()
        out = []
        for i, row in enumerate(self.rows):
            if row.pending:
                out.append(self._accept(row, tokens[i], row.logprobs))
            row.pending = True
            if row.state.request.params.logprobs:
                row.logprobs = logprobs[i]
        self.inputs = nxt
        return out

    def _sample(self, logits: mx.array, current: mx.array) -> tuple[mx.array, mx.array]:
        """Next token of every row, each with its own settings; and the log-probabilities."""
        if all(r.greedy for r in self.rows):
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return mx.argmax(logprobs, axis=-1), logprobs
        tokens, rows_lp = [], []
        for i, row in enumerate(self.rows):
            if row.processors:
                row.history = mx.concatenate([row.history, current[i: i + 1]])
            token, lp = self._sample_one(row, logits[i: i + 1])
            tokens.append(token.astype(mx.uint32))
            rows_lp.append(lp)
        return mx.concatenate(tokens), mx.concatenate(rows_lp)

    def _accept(self, row: Row, token: int, logprobs: mx.array | None) -> Emitted:
        state = row.state
        logprob = None
        if state.request.params.logprobs and logprobs is not None:
            logprob = token_logprob(logprobs, token, state.request.params.top_logprobs,
                                    self.tokenizer.decode)
        return Emitted(state, state.accept_token(token, logprob))
