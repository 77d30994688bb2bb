"""Prefill groups: admitted requests whose prompts run through the model together.

Requests that start prefilling in the same step form a *group*: their
prompts are left-padded to a common width and fed as one ``(rows, chunk)``
model call per chunk, into a multi-row paged batch (each row's blocks under its
own owner, in the pool's KV arena; padding columns are never stored)::

    width 7        columns fed per call: ``chunk`` (bounded by the step budget)
    row a: . . a a a a a      left padding 2
    row b: b b b b b b b      left padding 0
    row c: . . . . c c c      left padding 4

One call over many prompts keeps the matrix multiplications large, which
is what makes prompt processing fast on a CPU. When the last column is in,
every row's first token is sampled and the group waits to join the decode
batch as a whole (``extend``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from server.engine.kv_memory import PrefixHit
from server.engine.sampling import (
    Sampler,
    ban,
    batchable,
    build_logits_processors,
    build_sampler,
    mask_logits,
    sample_one,
)
from server.protocol import SamplingParams
from veloxquant_mlx.llama_model import Model as OwnedModel
from veloxquant_mlx.memory.block_pool import Block
from veloxquant_mlx.memory.kv_arena import KVArena
from veloxquant_mlx.memory.paged_batch import PagedKVBatch
from veloxquant_mlx.memory.pool_backed import PoolBackedKVCache
from veloxquant_mlx.memory.request_blocks import make_batch_caches

if TYPE_CHECKING:
    from server.text.grammar import Matcher

# Model modules (mlx-lm's and the project's) whose ``Model.__call__`` is the backbone
# (``model.model``) then the vocabulary projection (the tied embedding or ``lm_head``),
# nothing else.
# A prompt's last call of such a model projects its last column only
# (:func:`last_column_logits`).
BACKBONE_THEN_HEAD = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3",
                      "veloxquant_mlx.llama_model")

# For other models: a group whose last chunk spans at least this many prompt
# positions (rows x columns) feeds its last column in a call of its own: only
# that call's logits are ever evaluated, so the vocabulary projection of every
# other position is never computed (MLX is lazy). It costs one more small
# model call, which pays off once the skipped projections outweigh it (~1/10
# of a prefill's FLOPs on the small model; a 1-row, 64-token prompt would lose).
LAST_COLUMN_ALONE_MIN = 256


def projects_last_column(model: Any) -> bool:
    """Whether :func:`last_column_logits` can skip ``model``'s other columns."""
    cls = type(model)
    return (cls.__name__ == "Model" and cls.__module__ in BACKBONE_THEN_HEAD
            and hasattr(model, "model") and hasattr(model, "args"))


def last_column_logits(model: Any, x: mx.array, cache: list) -> mx.array:
    """``(rows, vocab)`` logits of ``x``'s last column, the others never projected.

    A prompt's first token needs only its last position's logits; projecting
    every position onto the vocabulary costs as much as a few layers (SmolLM2:
    49,152 x 576 per position, ~80 ms for a 64-token prompt on this CPU).
    """
    if not projects_last_column(model):
        return model(x, cache=cache)[:, -1, :]
    if isinstance(model, OwnedModel):  # its last block computes the last column alone
        hidden = model.model(x, cache, last_column=True)
    else:
        hidden = model.model(x, cache)[:, -1:, :]
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)[:, -1, :]
    return model.lm_head(hidden)[:, -1, :]


# Smallest chunk of a time-sliced prefill (columns): below it, per-call costs dominate.
MIN_SLICED_CHUNK = 64


@dataclass(slots=True)
class Row:
    """One request's place in prefill and decode.

    Attributes:
        owner: The request's owner id (its blocks in every layer are checked out under it).
        prompt_ids: The prompt tokens.
        want_logprobs: Hand back the distribution each token was drawn from.
        sampler: Draws a token from ``(1, vocab)`` log-probabilities.
        processors: mlx-lm logits processors (penalties, logit bias).
        greedy: Temperature 0 and no processors: batch-wide argmax applies.
        params: The request's sampling settings.
        shared: Samples with the batch-wide sampler (no seed, no processors).
        history: Prompt plus tokens fed so far, for the processors only.
        first: The first token (``(1,)``), sampled at the end of the prefill.
        logprobs: Distribution the pending token was drawn from (if asked for).
        pending: The row's current input token was not sent to the client yet.
        left: Tokens still to hand to its client before its ``max_tokens`` (a read of its
            pending token when ``left`` is 1 is its last: no model call need follow it).
        matcher: Its grammar's state (structured outputs), None for free text.
        prefix_keys: Keys of the prompt's full blocks (prefix caching; else empty).
        cached_blocks: Cached blocks its prompt starts on, ``[position][stream]``.
        prefix_root: The root its keys chain from (empty: nothing to publish).
        fed: Generated tokens fed to the model so far (kept only with prefix caching:
            its output's full blocks are cached when it ends), else None.
        task: A whole-prompt task (scoring, :mod:`server.engine.tasks`; an embedding,
            :mod:`server.engine.tasks`): the row prefills alone, its task reads
            every position, and it generates nothing. None for a generation.
        kv: Its KV: one :class:`PoolBackedKVCache` per layer over the pool's storage,
            owned by ``owner``; the batches it runs in read and grow their block table.
    """

    owner: int
    prompt_ids: list[int]
    want_logprobs: bool
    sampler: Sampler
    processors: list[Callable]
    greedy: bool
    params: SamplingParams | None = None
    shared: bool = False
    history: mx.array | None = None
    first: mx.array | None = None
    logprobs: mx.array | None = None
    pending: bool = False
    left: int = 0
    matcher: Matcher | None = None
    prefix_keys: list[bytes] = field(default_factory=list)
    cached_blocks: list[list[Block]] = field(default_factory=list)
    prefix_root: bytes = b""
    fed: list[int] | None = None
    task: Any = None  # a tasks.PromptScores or PromptEmbedding (tasks sits above)
    kv: list[PoolBackedKVCache] = field(default_factory=list)

    @classmethod
    def start(cls, owner: int, prompt_ids: list[int], params: SamplingParams,
              prefix: PrefixHit | None, task: Any, kv: list[PoolBackedKVCache]) -> Row:
        """A request's row, before its prefill: its sampler and processors from
        ``params``, the cached ``prefix`` it starts on (None: caching off), its KV."""
        processors = build_logits_processors(params, len(prompt_ids))
        row = cls(owner, prompt_ids, params.logprobs, build_sampler(params), processors,
                  greedy=params.temperature == 0.0 and not processors, params=params,
                  shared=batchable(params), task=task, kv=kv, left=params.max_tokens)
        if prefix is not None:
            row.prefix_keys, row.cached_blocks = prefix.keys, prefix.blocks()
            row.prefix_root = prefix.root
            row.fed = []
        if processors:
            row.history = mx.array(prompt_ids)
        if params.constraint is not None:
            row.matcher = params.constraint.matcher()
        return row

    def fed_ids(self, block_size: int) -> list[int]:
        """The prompt tokens prefill computes: those after the shared blocks."""
        return self.prompt_ids[len(self.cached_blocks) * block_size:]


@dataclass(slots=True)
class PrefillGroup:
    """Rows prefilling together.

    Invariant: ``rows``, ``prompts`` and the rows of ``batch`` correspond;
    ``prompts[i]`` is row ``i``'s prompt left-padded to ``width``, and
    columns ``[0, done)`` of it are in the batch.
    """

    rows: list[Row]
    batch: PagedKVBatch
    prompts: list[list[int]]
    width: int
    done: int = 0
    # Prompt tokens a second of a task group's last chunk (None: not timed yet). A
    # scoring chunk projects every position onto the vocabulary, and its attention
    # grows with its depth: the prefill rate of other groups says little about it.
    rate: float | None = None

    @classmethod
    def form(cls, waiting: list[Row], model: Any, arena: KVArena,
             max_tokens: int, solo: set[int]) -> PrefillGroup:
        """Take rows off the head of ``waiting`` (first come first served) into a group.

        A row joins while the padded group (rows x width) stays within
        ``max_tokens``; the first row always does. Owners in ``solo`` (their
        group's model call failed once) prefill alone, so a fault is pinned on
        the request that causes it; so does a row with a whole-prompt task (its
        calls read every position, which no other row needs).
        """
        bs = arena.block_size
        take = 1
        width = len(waiting[0].fed_ids(bs))
        alone = waiting[0].owner in solo or waiting[0].task is not None
        while take < len(waiting) and not alone:
            if waiting[take].owner in solo or waiting[take].task is not None:
                break
            w = max(width, len(waiting[take].fed_ids(bs)))
            if (take + 1) * w > max_tokens:
                break
            take, width = take + 1, w
        rows = waiting[:take]
        del waiting[:take]
        fed = [r.fed_ids(bs) for r in rows]
        pads = [width - len(ids) for ids in fed]
        batch = make_batch_caches(model, arena, [r.kv for r in rows], pads)
        for i, row in enumerate(rows):
            if row.cached_blocks:  # its table starts on the cached blocks; only the rest is fed
                batch.share_prefix(i, row.cached_blocks)
        prompts = [[0] * p + ids for p, ids in zip(pads, fed, strict=True)]
        return cls(rows, batch, prompts, width)

    def advance(self, model: Any, chunk: int, budget: int) -> tuple[int, mx.array | None]:
        """Feed the next columns (at most ``chunk``, about ``budget`` tokens in all).

        Returns:
            Tokens fed (padding included), and the last position's logits
            ``(rows, vocab)`` once the whole prompt is in (else None).
        """
        rows, left = len(self.rows), self.width - self.done
        n = min(chunk, left, max(budget // rows, 1))
        task = self.rows[0].task
        if task is not None:  # every position read, no first token
            fed = task.step(model, self.batch.caches, n)
            self.done += fed
            return fed, None
        if (n == left > 1 and rows * (left - 1) >= LAST_COLUMN_ALONE_MIN
                and not projects_last_column(model)):
            n = left - 1
        x = mx.array([p[self.done: self.done + n] for p in self.prompts])
        self.done += n
        if self.done < self.width:
            model(x, cache=self.batch.caches)  # its logits are never used: only the KV
            # Start the chunk on the device without waiting for it (the host
            # syncs once per step, when it reads tokens); this also keeps the
            # next chunk's graph from growing on top of this one.
            mx.async_eval(self.batch.arena.data)
            return n * len(self.rows), None
        return n * len(self.rows), last_column_logits(model, x, self.batch.caches)

    def first_tokens(self, logits: mx.array, share: Callable[[mx.array], mx.array]) -> None:
        """Sample every row's first token, lazily: it is read with the next decode's tokens.

        No evaluation here: reading the tokens now would make the host wait for
        the device in the middle of a step. The first token becomes the row's
        decode input, and the decode that feeds it reads it (``pending``). ``share``
        hands the tokens to the other ranks of a split model (identity alone).
        """
        for i, row in enumerate(self.rows):
            raw = logits[i: i + 1]
            if row.params is not None and row.params.banned_tokens:
                banned = mx.array(row.params.banned_tokens, dtype=mx.int32)
                raw = ban(raw, mx.zeros_like(banned), banned)
            if row.matcher is None:
                token, logprobs = sample_one(row, raw)
            else:  # the grammar's start state: no token needed, its mask is cached
                words = mx.array(row.matcher.constraint.first_mask()[None])
                token, _ = sample_one(row, mask_logits(raw, words, mx.array([False])))
                logprobs = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
            row.first, row.pending = share(token.astype(mx.uint32)), True
            row.logprobs = logprobs[0] if row.want_logprobs else None

    def drop(self, owners: set[int]) -> None:
        """Remove the rows of ``owners``; a group left empty closes its batch."""
        keep = [i for i, r in enumerate(self.rows) if r.owner not in owners]
        if len(keep) < len(self.rows):
            self.keep(keep)
            if not keep:
                self.batch.close()

    def keep(self, indices: list[int]) -> None:
        """Keep only rows ``indices``; the others' blocks return to the pool now."""
        self.batch.filter(indices)
        self.rows = [self.rows[i] for i in indices]
        self.prompts = [self.prompts[i] for i in indices]


def sliced_chunk(group: PrefillGroup, chunk: int, rate: float | None, seconds: float) -> int:
    """Columns of ``group``'s next chunk while rows wait for a time-sliced prefill: what
    runs in ``seconds`` at the measured ``rate`` (prompt tokens a second; a task group
    keeps its own), a small first chunk to measure it when nothing has been timed yet,
    never more than the configured ``chunk``."""
    scoring = group.rows[0].task is not None  # a whole-prompt task's group
    rate = group.rate if scoring else rate
    if rate is None:
        return min(chunk, MIN_SLICED_CHUNK)
    if scoring:  # the next chunk sits deeper in the prompt, so it runs slower
        seconds /= 2
    columns = int(rate * seconds / len(group.rows))
    return min(chunk, max(MIN_SLICED_CHUNK, columns // 16 * 16))


def join_groups(groups: list[PrefillGroup], batch: PagedKVBatch | None,
                inputs: mx.array | None, write_back: int) -> tuple[PagedKVBatch, mx.array]:
    """The decode batch and its inputs once prefilled ``groups`` joined it (their first
    tokens are the rows' first decode inputs); ``batch`` None: the first group is it."""
    for group in groups:
        first = mx.concatenate([row.first for row in group.rows])
        if batch is None:
            batch, inputs = group.batch, first
            batch.write_back = write_back
        else:
            batch.extend(group.batch)
            group.batch.close()  # emptied by extend
            inputs = mx.concatenate([inputs, first])
        for row in group.rows:
            row.first = None
    return batch, inputs
