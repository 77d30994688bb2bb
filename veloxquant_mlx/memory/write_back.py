"""Decode columns held out of the KV arena, then written in one scatter (write-back).

Why: a scatter into an MLX array can only update it in place when nothing
else still reads that buffer. On a GPU, the kernels of the step in flight
always do (every layer gathers its stored tokens from the arena), so each
write into the arena copies all of it: measured on an H200, 3.6 ms of a
5.4 ms decode step for a 1 GiB arena, and more for a larger pool. A decode
batch therefore keeps its last columns out of the arena::

    held columns, shared by the batch's rows (one per decode call)
      layer l: (2 x rows, H_kv, held, D)    keys' rows, then values' rows
      row r's own columns: [start_r, held)  (a row that joined later has fewer)
    each decode call: attention reads the arena's stored tokens (gathered), then
      the held columns plus the call's own (one array); the call's column is held too
    ``limit`` columns held (or a prefill-sized call, or a flush): ONE scatter writes
      every held column of every layer and row into its slots; the arena is copied
      once per ``limit`` decode steps instead of once per step

The pool's accounting does not change: a row's blocks are taken as its tokens
arrive, held or written. What is held is transient memory, bounded by
:func:`held_bytes` and counted in the workspace.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def held_bytes(n_layers: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype,
               max_rows: int, limit: int) -> int:
    """Most bytes the held columns of one batch take, with the copies that handle them.

    The held columns of every layer (keys and values, ``limit`` each, in the
    compute dtype) and at most three copies of that size while they are
    written: the flush stacks every layer, lays the stack out for the
    scatter, and a quantized arena encodes it (each call's append also
    builds one layer's new array while the old one is alive, well within).
    """
    if limit <= 1:
        return 0
    return 4 * n_layers * 2 * max_rows * n_kv_heads * limit * head_dim * dtype.size


class HeldColumns:
    """The columns a decode batch holds back from the arena (module docstring).

    Args:
        n_layers: The model's layers.
        limit: Most columns held before they are written; 1 writes every call.
        rows: The batch's rows now.
    """

    def __init__(self, n_layers: int, limit: int, rows: int) -> None:
        if limit < 1:
            raise ValueError(f"write-back limit must be at least 1 column, got {limit}")
        self.limit = limit
        self._layers: list[mx.array | None] = [None] * n_layers
        self.clear(rows)  # count, start (per row: its first held column), _start

    def per_row(self) -> np.ndarray:
        """Columns each row holds (the newest of its tokens, not yet in the arena)."""
        return self.count - self.start

    def open(self) -> None:
        """A decode call begins: its column becomes the newest held one."""
        self.count += 1

    def append(self, layer: int, new: mx.array) -> mx.array:
        """Hold the call's ``new`` keys+values of ``layer``; return all held ones, own last.

        Args:
            layer: The layer index.
            new: ``(2 x rows, H_kv, 1, D)``, keys' rows then values' rows.
        """
        old = self._layers[layer]
        held = new if old is None else mx.concatenate([old, new], axis=2)
        self._layers[layer] = held
        return held

    def mask(self) -> mx.array:
        """``(rows, 1, 1, count)``: True where a held column is the row's own."""
        if self._start is None:  # built again only when rows join or leave, or after a write
            self._start = mx.array(self.start)[:, None]
        visible = mx.arange(self.count)[None, :] >= self._start
        return visible[:, None, None, :]

    def keep(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (in that order); the others' held columns are dropped."""
        if not keep:
            self.clear(0)
            return
        self.start, self._start = self.start[keep], None
        if self.count:
            rows = len(self._layers[0]) // 2
            take = mx.array(keep + [rows + i for i in keep], dtype=mx.int32)
            self._layers = [held[take] for held in self._layers]

    def add_rows(self, added: int) -> None:
        """``added`` rows join after the others, holding nothing yet."""
        if self.count:
            def widen(held: mx.array) -> mx.array:
                rows = held.shape[0] // 2
                none = mx.zeros((added, *held.shape[1:]), held.dtype)
                return mx.concatenate([held[:rows], none, held[rows:], none])
            self._layers = [widen(held) for held in self._layers]
        self.start = np.concatenate([self.start, np.full(added, self.count, np.int64)])
        self._start = None

    def stacked(self) -> mx.array:
        """Every held column as ``(H_kv, layers x 2 x rows x count, D)`` for one scatter.

        Column order: layer, then keys' rows then values' rows, then held column.
        """
        values = mx.stack(self._layers)  # (layers, 2 x rows, H, count, D)
        heads, dim = values.shape[2], values.shape[4]
        return values.transpose(2, 0, 1, 3, 4).reshape(heads, -1, dim)

    def clear(self, rows: int) -> None:
        """Hold nothing, for ``rows`` rows (after a flush, or when every row left)."""
        self.count = 0  # columns held, the batch's shared timeline
        self.start = np.zeros(rows, np.int64)
        self._start: mx.array | None = None  # ``start`` on the device, for mask()
        self._layers = [None] * len(self._layers)
