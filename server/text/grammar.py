"""Structured outputs at run time: a compiled grammar, one matcher per row, token masks.

The grammar library is llguidance (see the README's "Structured outputs"
section for the measured choice). A :class:`Constraint` is compiled once per
``(type, schema)`` (server.text.schemas) and shared; every row that uses it
gets its own :class:`Matcher` (a copy of the compiled matcher in its start
state), which the runner advances with each sampled token and asks for the
next token mask::

    Constraint.matcher()                    -> Matcher (one per row, engine thread)
    Matcher.consume(token); fill_masks(...) -> bit mask of the next token, 1 bit per id

When the document is complete the mask allows only the end tokens, so a
constrained row stops with ``finish_reason: "stop"`` right after its JSON.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np

from server.protocol import (
    ConstraintError,  # noqa: F401 - raised here, part of this API
)


class ConstraintViolation(RuntimeError):
    """A row's sampled token was refused by its grammar, although its own mask allowed it.

    The grammar reached a state with no way on: llguidance lets the first
    token of a schema that admits no finite JSON value through (an object whose
    required property recursively requires the object again) and refuses it
    once consumed. The request is answered 400 (``invalid_value``): it asked
    for output that cannot exist.
    """


class Constraint:
    """A compiled grammar, shareable across rows and threads.

    Read-only once built, apart from its start-state mask, computed once on
    first use (engine thread).

    Args:
        kind: ``"json_object"`` or ``"json_schema"``.
        name: The schema's name (``json_schema.name``), or the kind.
        proto: llguidance's matcher in its start state; rows copy it.
        vocab: Token ids the mask covers (the tokenizer's vocabulary).
        nbytes: Estimated memory it holds (its matcher and its start-state mask).
    """

    __slots__ = ("kind", "name", "_proto", "vocab", "nbytes", "_first")

    def __init__(self, kind: str, name: str, proto: llguidance.LLMatcher, vocab: int,
                 nbytes: int = 0) -> None:
        self.kind, self.name, self._proto, self.vocab = kind, name, proto, vocab
        self.nbytes = nbytes
        self._first: np.ndarray | None = None

    def matcher(self) -> Matcher:
        """A fresh matcher for one row, in the grammar's start state."""
        return Matcher(self._proto.deep_copy(), self)

    def first_mask(self) -> np.ndarray:
        """The start state's bit mask ``(words,)`` int32 (the same for every row: cached)."""
        if self._first is None:
            mask = np.zeros((1, mask_words(self.vocab)), dtype=np.int32)
            fill_masks([(self._proto.deep_copy(), 0)], mask)
            self._first = mask[0]
        return self._first

    def __repr__(self) -> str:
        return f"Constraint({self.kind}, {self.name!r})"


class Matcher:
    """One row's place in its grammar (engine thread only)."""

    __slots__ = ("ll", "constraint")

    def __init__(self, ll: llguidance.LLMatcher, constraint: Constraint) -> None:
        self.ll, self.constraint = ll, constraint

    def consume(self, token: int) -> None:
        """Advance past ``token``.

        Raises:
            ConstraintViolation: the grammar refuses it.
        """
        try:
            accepted = self.ll.consume_token(token)
        except ValueError as exc:  # llguidance raises where its parser gave up
            raise self.dead_end(f"token {token}: {exc}") from None
        if not accepted:
            raise self.dead_end(f"token {token} refused: {self.ll.get_error() or 'no reason'}")

    def dead_end(self, why: str) -> ConstraintViolation:
        """The error of this row's grammar having no way on (see :class:`ConstraintViolation`).

        Only the first line of llguidance's reason: the rest is a dump of its parser state.
        """
        why = why.split("\n", 1)[0]
        return ConstraintViolation(
            f"the {self.constraint.kind} constraint {self.constraint.name!r} reached a state "
            f"with no way to finish ({why}); its schema may admit no finite value, such as a "
            "required property that requires its own object again")


def mask_words(vocab: int) -> int:
    """int32 words of a bit mask over ``vocab`` token ids."""
    return (vocab + 31) // 32


_EXECUTOR: llguidance.LLExecutor | None = None


def fill_masks(rows: Sequence[tuple[llguidance.LLMatcher, int]], bitmask: np.ndarray) -> None:
    """Write each matcher's next-token mask into row ``index`` of ``bitmask`` (parallel).

    Args:
        rows: ``(llguidance matcher, row of bitmask)`` pairs.
        bitmask: C-contiguous int32 ``(batch, words)``; other rows are left as they are.
    """
    global _EXECUTOR
    if _EXECUTOR is None:  # a thread pool of llguidance's own, made on first use
        _EXECUTOR = llguidance.LLExecutor()
    _EXECUTOR.unsafe_compute_mask_ptr(list(rows), bitmask.ctypes.data, bitmask.shape[1] * 4,
                                      bitmask.shape[0])


class BatchMasks:
    """Next-token bit masks of a decode batch, in one buffer reused every step.

    Row ``i`` of :attr:`bitmask` is row ``i`` of the batch; free rows (no
    matcher) keep every bit set. Built when the batch's rows change.

    Args:
        matchers: Each row's matcher, None for a free row (at least one is not None).
    """

    __slots__ = ("bitmask", "free", "_rows", "_targets")

    def __init__(self, matchers: Sequence[Matcher | None]) -> None:
        vocabs = {m.constraint.vocab for m in matchers if m is not None}
        if len(vocabs) != 1:
            raise ValueError(f"constrained rows of one batch must share a vocabulary: {vocabs}")
        self.bitmask = np.full((len(matchers), mask_words(vocabs.pop())), -1, dtype=np.int32)
        self.free = [m is None for m in matchers]
        self._rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
        self._targets = [(m.ll, i) for i, m in self._rows]  # what fill_masks takes

    def step(self, tokens: Sequence[int]) -> list[tuple[int, ConstraintViolation]]:
        """Advance every constrained row past its token, then fill the next masks.

        Args:
            tokens: Each row's current token (free rows' are ignored).

        Returns:
            ``(row, error)`` of rows whose token was refused; their masks are
            left all-allowed (the caller fails them after the step).
        """
        refused = []
        for i, matcher in self._rows:
            try:
                matcher.consume(tokens[i])
            except ConstraintViolation as exc:
                refused.append((i, exc))
        self._drop(refused)
        try:
            fill_masks(self._targets, self.bitmask)
        except ValueError:  # a grammar whose parser gave up: find its row, keep the others
            broken = []
            for i, matcher in self._rows:
                try:
                    fill_masks([(matcher.ll, i)], self.bitmask)
                except ValueError as exc:
                    broken.append((i, matcher.dead_end(str(exc))))
            self._drop(broken)
            refused += broken
        return refused

    def _drop(self, refused: list[tuple[int, ConstraintViolation]]) -> None:
        """Rows whose grammar failed leave the masks; their rows allow every token."""
        if refused:
            gone = {i for i, _ in refused}
            self._rows = [(i, m) for i, m in self._rows if i not in gone]
            self._targets = [(ll, i) for ll, i in self._targets if i not in gone]
            self.bitmask[sorted(gone)] = -1
