"""Attention over a paged batch's gathered KV, fast on MLX's CPU backend.

Why this exists: on the CPU, ``mx.fast.scaled_dot_product_attention`` falls
back to plain ops whose softmax calls a scalar ``exp`` per score (measured
here: ~12 ns each, 8 ms for the 665k scores of one layer of a 65-token
prompt over a 1,072-token cached prefix; the two matmuls around it take
1.4 ms). Attention over a long context is therefore most of a cached
prompt's time to first token. This module computes the same attention with:

- an ``exp`` built from MLX's vectorised elementwise ops (range reduction to
  ``2**n * 2**f`` with ``|f| <= 1/2``, a degree-7 Taylor polynomial for
  ``2**f``, ``2**n`` written into the float's exponent bits), fused by
  ``mx.compile``: relative error under 2e-7 (float32's own rounding is
  6e-8), ``exp(-inf) == 0`` exactly, 3-4x faster than ``mx.exp``;
- for short queries (decode), scores computed as ``keys @ queries^T``: the
  keys are read in their stored layout, where ``queries @ keys^T`` has BLAS
  transpose every row's keys (1.85x slower measured at 16 rows x 1,100
  tokens);
- the tokens gathered from the arena and the call's new ones attended as two
  parts under one softmax (:func:`attention_parts`), so the gathered keys
  and values are never copied again into one concatenated buffer, and the
  stored tokens' mask is one row per batch row, not one per query.

:func:`scaled_dot_product_attention` is what the project's Llama-shaped
model (:mod:`veloxquant_mlx.llama_model`) calls: this path for float32 calls
on a :class:`PagedLayerCache` on the CPU whose batch has ``fast_attention``
(the default); every other call (other caches, other dtypes, the GPU) goes to
mlx-lm's own function unchanged, so the library's single-request path keeps
its bit-identity contract, and ``fast_attention=False`` gives a paged batch
the stock cache's very logits. The logits differ from mlx-lm's by ~1e-6 (the sums
run in another order); measured on SmolLM2 with OpenBLAS: prefill 25%
faster (a 65-token prompt over a 1,072-token cached prefix: 554 -> 412 ms;
512 tokens cold: 3.29 -> 2.45 s), decode 3-6% faster.

A prompt chunk (:data:`native_attention.MIN_QUERIES` query columns or more) goes
further, where the BLAS forward is loaded: to the C kernel of
:mod:`~veloxquant_mlx.memory.native_attention`, whose softmax is one vectorised pass
a row (a 4,096-token SmolLM2 prompt: 50.0 -> 25.5 s to its first token).

Small calls stay on mlx-lm's attention (:data:`FAST_MIN_SCORES`): this path
issues ~25 MLX ops per layer where the stock one issues ~10, and each op
costs the CPU stream tens of microseconds whatever its size. One decode row
over ~100 tokens (900 scores a layer) ran ~6 ms a step slower here (57.7 vs
51.0 ms on SmolLM2), over 1,000 tokens ~6 ms faster; 16 rows over ~100
tokens ~25 ms faster.

Decode calls (one query column a row) with up to :data:`NATIVE_MAX_SCORES` scores go
to neither: the extension's ``decode_attention`` (``veloxquant_mlx/kernels``) attends
over the stored and new parts as one graph node, where MLX's ops are ~17 a layer
(measured per layer call, SmolLM2's 9 heads: 1 row over 2,048 keys 0.35 vs 1.29 ms; 16
rows over 512 keys 0.71 vs 3.8 ms; a 1B model's 32 heads, 8 rows over 600 keys: 2.2 vs
5.7 ms). Larger calls keep MLX's products.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention as stock_attention

from veloxquant_mlx.memory import native_attention
from veloxquant_mlx.memory.paged_layer_cache import PagedLayerCache, split_parts

_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)
_TAYLOR = [_LN2**k / math.factorial(k) for k in range(8)]  # 2**f = sum (f ln2)^k / k!
# Query columns (heads per KV head x new tokens) up to which the scores are
# computed as keys @ queries^T (see the module docstring).
KEYS_FIRST_MAX_COLUMNS = 16
# Most scores one block of query columns computes at once (see attention()).
SCORES_PER_BLOCK = 1 << 19
# Fewest scores per layer (batch x query heads x queries x keys) a call needs
# before this path beats mlx-lm's on the op count it adds (module docstring).
FAST_MIN_SCORES = 4096
# Most scores a decode call (one query column a row) may have to go to the native
# ``decode_attention`` operation: one node on the codes kernel's threads. It was faster
# than MLX's ops up to the largest calls measured (64 rows x 9 heads x 1,024 keys: 6.9
# vs 32.6 ms); bigger ones use MLX's products.
NATIVE_MAX_SCORES = 1 << 20


@functools.cache
def native_ops() -> Any | None:
    """The extension (veloxquant_mlx/kernels) with ``decode_attention`` and
    ``paged_decode_attention``, or None where it cannot be built (MLX's ops serve then)."""
    from veloxquant_mlx.kernels.build import KernelBuildError, load

    try:
        return load()
    except (KernelBuildError, OSError, ImportError):
        return None


def native_decode_attention() -> Any | None:
    """The extension's ``decode_attention``, or None where it cannot be built."""
    ops = native_ops()
    return None if ops is None else ops.decode_attention


def paged_decode(queries: mx.array, new: mx.array, cache: Any, scale: float,
                 mask: Any) -> mx.array | None:
    """A decode call's attention that reads the stored keys and values in the arena's
    blocks (``paged_decode_attention``), after handing ``new`` (keys over values) to
    ``cache``; None, with nothing handed over, where it does not apply.

    It applies where the gathered path's native call would (float32, one query column,
    the batch's own mask or none, the CPU, up to :data:`NATIVE_MAX_SCORES`), on a float
    arena. What it saves is the per-layer gather: a copy of every row's stored KV each
    step (16 SmolLM2 rows over ~140 tokens: ~3.5 MB a layer, ~0.4 ms).
    """
    if queries.shape[2] != 1 or not _on_cpu_paths(queries, new, cache, mask):
        return None
    ops = native_ops()
    if ops is None:
        return None
    rows, heads = queries.shape[:2]
    parts = cache.paged_parts(new, mask, NATIVE_MAX_SCORES // (rows * heads))
    if parts is None:
        return None
    arena, table, columns, fresh, stored_mask, fresh_mask = parts
    return ops.paged_decode_attention(queries, arena, table, columns, fresh, stored_mask,
                                      fresh_mask, scale=scale, block_size=cache.batch.bs)


def _on_cpu_paths(queries: mx.array, keys: mx.array, cache: Any, mask: Any) -> bool:
    """Whether a call may take this module's CPU paths: float32 queries and keys on a
    :class:`PagedLayerCache` whose batch has ``fast_attention``, a boolean mask or none,
    on the CPU."""
    return (isinstance(cache, PagedLayerCache) and cache.batch.fast_attention
            and queries.dtype == mx.float32 and keys.dtype == mx.float32
            and (mask is None or (isinstance(mask, mx.array) and mask.dtype == mx.bool_))
            and mx.default_device().type == mx.DeviceType.cpu)


def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """``2**f`` and the float32 bits of ``2**n`` with ``n + f = x log2(e)``."""
    y = mx.maximum(x * _LOG2E, -127.0)  # 2**-127 is below float32's normal range
    n = mx.floor(y + 0.5)
    f = y - n
    p = _TAYLOR[7]
    for c in reversed(_TAYLOR[:7]):
        p = p * f + c
    # n = -127 gives exponent bits 0: exactly 0.0, which is what exp(-inf) needs.
    return p, (n.astype(mx.int32) + 127) << 23


# Shapeless: one trace serves every shape (a bit-cast cannot be traced
# shapeless, so it stays outside, a free view of the int32 result).
_exp_parts_fused = mx.compile(_exp_parts, shapeless=True)


def fast_exp(x: mx.array) -> mx.array:
    """``exp(x)`` for float32 ``x <= 0`` (what a softmax feeds it); -inf -> 0."""
    p, bits = _exp_parts_fused(x)
    return p * bits.view(mx.float32)


def softmax(x: mx.array, axis: int) -> mx.array:
    """Softmax of float32 scores along ``axis`` using :func:`fast_exp`."""
    e = fast_exp(x - mx.max(x, axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask: mx.array | None) -> mx.array:
    """Grouped-query attention, as ``mx.fast.scaled_dot_product_attention`` computes it.

    Args:
        queries: ``(B, Hq, L, D)``.
        keys: ``(B, Hkv, S, D)``; ``Hq`` is a multiple of ``Hkv``.
        values: ``(B, Hkv, S, D)``.
        scale: Applied to the queries.
        mask: Boolean ``(B or 1, 1, L, S)``, True where a key is visible; or None.

    Returns:
        ``(B, Hq, L, D)``.
    """
    return attention_parts(queries, [keys], [values], scale, [mask])


def attention_parts(queries: mx.array, keys: Sequence[mx.array], values: Sequence[mx.array],
                    scale: float, masks: Sequence[mx.array | None],
                    causal_last: bool = False) -> mx.array:
    """:func:`attention` over keys and values given in parts along the sequence.

    The result is that of the parts concatenated (one softmax over all of
    them), without copying them into one buffer: a paged batch passes the
    tokens it gathered from the arena and the call's own new ones.
    ``masks[i]`` is part ``i``'s boolean mask, ``(B or 1, 1, L or 1, S_i)``,
    or None.

    Long prompts are taken in blocks of query columns so that no block has
    more than ``SCORES_PER_BLOCK`` scores: the fused exp slows down several
    times once its arrays outgrow the CPU caches (measured: 2 ms for 665k
    scores, 29 ms for 1.9M), and the transient scores stay small.

    ``causal_last``: the last part holds the queries' own tokens and its mask
    never lets query ``c`` see a key after ``c`` (a causal prompt). A block
    of query columns ``[i, i + step)`` then reads only that part's first
    ``i + step`` keys: a prompt's exps are about halved.
    """
    b, hq, n, _ = queries.shape
    if causal_last and keys[-1].shape[2] != n:
        raise ValueError(f"causal_last needs as many keys in the last part as queries "
                         f"({keys[-1].shape[2]} != {n})")
    step = max(1, SCORES_PER_BLOCK // (b * hq * sum(k.shape[2] for k in keys)))
    if n <= step:
        return _attend(queries, keys, values, scale, masks)

    def block(i: int) -> mx.array:
        end = i + step
        ks, vs = list(keys), list(values)
        ms = [m if m is None or m.shape[2] == 1 else m[:, :, i: end] for m in masks]
        if causal_last:  # the later keys of the last part are masked for every query here
            ks[-1], vs[-1] = ks[-1][:, :, :end], vs[-1][:, :, :end]
            ms[-1] = None if ms[-1] is None else ms[-1][..., :end]
        return _attend(queries[:, :, i: end], ks, vs, scale, ms)

    return mx.concatenate([block(i) for i in range(0, n, step)], axis=2)


def _attend(queries: mx.array, keys: Sequence[mx.array], values: Sequence[mx.array],
            scale: float, masks: Sequence[mx.array | None]) -> mx.array:
    b, hq, n, d = queries.shape
    hkv = keys[0].shape[1]
    rep = hq // hkv
    q = (queries * scale).reshape(b, hkv, rep * n, d)
    keys_first = rep * n <= KEYS_FIRST_MAX_COLUMNS
    scores = []
    for k, m in zip(keys, masks, strict=True):
        if keys_first:  # (B, Hkv, S_i, rep, L)
            part = (k @ q.swapaxes(-1, -2)).reshape(b, hkv, k.shape[2], rep, n)
            if m is not None:
                part = mx.where(m.swapaxes(-1, -2)[:, :, :, None, :], part, -mx.inf)
        else:  # (B, Hkv, rep, L, S_i)
            part = (q @ k.swapaxes(-1, -2)).reshape(b, hkv, rep, n, k.shape[2])
            if m is not None:
                part = mx.where(m[:, :, None], part, -mx.inf)
        scores.append(part)
    axis = 2 if keys_first else 4
    weights = softmax(scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=axis),
                      axis=axis)
    out, start = None, 0
    for k, v in zip(keys, values, strict=True):
        size = k.shape[2]
        if keys_first:
            w = weights[:, :, start: start + size].reshape(b, hkv, size, rep * n).swapaxes(-1, -2)
        else:
            w = weights[..., start: start + size].reshape(b, hkv, rep * n, size)
        out = w @ v if out is None else out + w @ v
        start += size
    return out.reshape(b, hq, n, d)


def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array,
                                 cache: Any, scale: float, mask: Any) -> mx.array:
    """A Llama-shaped attention's call: this module's path where it applies, else mlx-lm's.

    It applies to float32 calls on a :class:`PagedLayerCache` on the CPU whose batch has
    ``fast_attention`` and that are big enough (:data:`FAST_MIN_SCORES`); every other
    call (other caches, other dtypes, the GPU) goes to mlx-lm's own function unchanged.
    :mod:`veloxquant_mlx.llama_model` calls it explicitly.
    """
    if _on_cpu_paths(queries, keys, cache, mask):
        stacked = cache.stacked_parts(mask)  # taken either way: held no longer than the call
        scores = math.prod(queries.shape[:3]) * keys.shape[2]
        if (stacked is not None and stacked[0] is not None and queries.shape[2] == 1
                and scores <= NATIVE_MAX_SCORES and (op := native_decode_attention())):
            return op(queries, *stacked, scale=scale)
        if scores >= FAST_MIN_SCORES:
            if stacked is None:
                return attention(queries, keys, values, scale, mask)
            parts = split_parts(*stacked)
            # The batch's mask of its new columns is causal (see PagedKVBatch.mask);
            # a decode call that holds its column has one query over the held ones.
            causal = parts[0][-1].shape[2] == queries.shape[2]
            if causal and queries.shape[2] >= native_attention.MIN_QUERIES:
                out = native_attention.try_causal_attention(queries, *parts, scale)
                if out is not None:
                    return out
            return attention_parts(queries, *parts[:2], scale, parts[2], causal_last=causal)
    elif isinstance(cache, PagedLayerCache):
        # Dropped unused too (a GPU call, another dtype): parts kept past their call
        # can pin the arena version they were read from, which on a GPU is a whole
        # copy after each write (an unclosed batch holds one until a gc).
        cache.parts = None
    return stock_attention(queries, keys, values, cache=cache, scale=scale, mask=mask)
