"""Continuous batching on the shared pool (engine thread only).

Every running request is a :class:`Row`. A row first *prefills*: its prompt
runs through the model in chunks into its own single-row pool-backed caches
(``make_batch_caches``, blocks under the request's owner), and its first
token is sampled and sent at once, so time to first token does not wait
for the batch. It then *joins* the decode batch at the next step boundary.
Each :meth:`DecodeBatch.step` decodes every joined row in ONE model call::

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
from server.request_state import RequestState
from server.sampling import Sampler, build_logits_processors, build_sampler, token_logprob
from veloxquant_mlx.memory import BlockPoolAllocator
from veloxquant_mlx.memory.pool_backed_batch import PoolBackedBatchKVCache, make_batch_caches


@dataclass(slots=True)
class Row:
    """One request's place in the batch.

    Attributes:
        state: The engine's record of the request.
        caches: Its single-row caches while prefilling (None once joined).
        sampler: Draws a token from ``(1, vocab)`` log-probabilities.
        processors: mlx-lm logits processors (penalties, logit bias).
        greedy: Temperature 0 and no processors: batch-wide argmax applies.
        history: Prompt plus tokens fed so far, for the processors only.
        first: The first token (``(1,)``), sampled at the end of the prefill.
        logprobs: Distribution the pending token was drawn from (if asked for).
        pending: The row's current input token was not sent to the client yet.
        prefilled: Prompt tokens already run through the model.
    """

    state: RequestState
    caches: list[PoolBackedBatchKVCache] | None
    sampler: Sampler
    processors: list[Callable]
    greedy: bool
    history: mx.array | None = None
    first: mx.array | None = None
    logprobs: mx.array | None = None
    pending: bool = False
    prefilled: int = 0


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
        prefill_chunk_size: Prompt tokens per prefill model call.
    """

    def __init__(self, model: Any, tokenizer: Any, pool: BlockPoolAllocator,
                 prefill_chunk_size: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.chunk = prefill_chunk_size
        self.prefilling: list[Row] = []
        self.joining: list[Row] = []
        self.rows: list[Row] = []
        self.caches: list[PoolBackedBatchKVCache] | None = None
        self.inputs: mx.array | None = None
        self._where: dict[int, Row] = {}  # owner -> row, wherever it is

    # -- rows in and out -------------------------------------------------------

    def add(self, state: RequestState) -> None:
        """Queue a just-admitted request for prefill (no model work yet)."""
        params = state.request.params
        processors = build_logits_processors(params)
        row = Row(state, make_batch_caches(self.model, self.pool, state.owner),
                  build_sampler(params), processors,
                  greedy=params.temperature == 0.0 and not processors)
        if processors:
            row.history = mx.array(state.prompt_ids)
        self.prefilling.append(row)
        self._where[state.owner] = row

    def remove(self, states: Sequence[RequestState]) -> dict[int, int]:
        """Take requests out wherever they are; their blocks of every layer go back now.

        Returns:
            Owner -> blocks it held just before leaving.
        """
        held = {s.owner: self.pool.n_blocks_held(s.owner) for s in states}
        gone = {s.owner for s in states if s.owner in self._where}
        if not gone:
            return held
        for owner in gone:
            del self._where[owner]
        for waiting in (self.prefilling, self.joining):
            for row in [r for r in waiting if r.state.owner in gone]:
                waiting.remove(row)
                for cache in row.caches or ():
                    cache.release()
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
        return len(self._where)

    # -- one engine step ---------------------------------------------------------

    def run_step(self, prefill_budget: int,
                 hook: Callable[[RequestState], None] | None = None) -> StepOutcome:
        """Prefill within ``prefill_budget`` prompt tokens, then one batched decode.

        A request whose prefill (or ``hook``, a per-request fault-injection
        hook called before its model work) raises fails alone; an error in the
        batched call fails every row in it. Failed requests leave the batch
        before the outcome is returned.
        """
        out = StepOutcome()
        for row in list(self.prefilling):
            if prefill_budget <= 0:
                break
            try:
                if hook is not None:
                    hook(row.state)
                used, emitted = self.prefill(row, prefill_budget)
            except Exception as exc:
                out.failed.append((row.state, exc))
                continue
            prefill_budget -= used
            if emitted is not None:
                out.emitted.append(emitted)
        if hook is not None:
            for row in self.rows + self.joining:
                try:
                    hook(row.state)
                except Exception as exc:
                    out.failed.append((row.state, exc))
        if out.failed:
            out.held.update(self.remove([state for state, _ in out.failed]))
        out.decoded_rows = len(self.rows) + len(self.joining)
        try:
            out.emitted += self.step()
        except Exception as exc:  # one model call for all rows: all of them fail
            failed = [row.state for row in self.rows]
            out.failed += [(state, exc) for state in failed]
            out.held.update(self.remove(failed))
            out.decoded_rows = 0
        return out

    # -- prefill -----------------------------------------------------------------

    def prefill(self, row: Row, budget: int) -> tuple[int, Emitted | None]:
        """Run up to ``budget`` more prompt tokens of ``row`` (at most one chunk).

        Returns:
            Prompt tokens processed, and the first token once the prompt is done
            (the row then waits in ``joining`` unless that token ended it).
        """
        ids = row.state.prompt_ids
        n = min(self.chunk, budget, len(ids) - row.prefilled)
        chunk = mx.array(ids[row.prefilled: row.prefilled + n])[None]
        logits = self.model(chunk, cache=row.caches)
        row.prefilled += n
        if row.prefilled < len(ids):
            mx.eval([(c.keys, c.values) for c in row.caches])
            return n, None
        token, logprobs = self._sample_one(row, logits[:, -1, :])
        mx.eval(token, logprobs)
        emitted = self._accept(row, token.item(), logprobs[0])
        self.prefilling.remove(row)
        if row.state.finish is None:
            row.first = token
            self.joining.append(row)
        return n, emitted

    def _sample_one(self, row: Row, logits: mx.array) -> tuple[mx.array, mx.array]:
        for processor in row.processors:
            logits = processor(row.history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return row.sampler(logprobs), logprobs

    # -- decode ------------------------------------------------------------------

    def _join(self) -> None:
        """Move prefilled rows into the batch (a step boundary)."""
        if not self.joining:
            return
        for row in self.joining:
            if self.caches is None:
                self.caches, self.inputs = row.caches, row.first
            else:
                for batch_layer, row_layer in zip(self.caches, row.caches, strict=True):
                    batch_layer.extend(row_layer)
                self.inputs = mx.concatenate([self.inputs, row.first])
            row.caches, row.first, row.pending = None, None, False
            self.rows.append(row)
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
