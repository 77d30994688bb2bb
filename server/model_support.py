"""Which mlx-lm models the KV pool serves, checked once at model load.

The pool holds one plain KV cache a layer: every layer keeps the keys and
values of every position, in blocks of one shape (:mod:`veloxquant_mlx.memory.kv_arena`).
A model whose mlx-lm module asks for anything else (a rolling window of the
last positions, a recurrent state, chunked attention, fewer caches than
layers) would run through the pool as full attention and answer other than
mlx-lm does, with no error; so such a model is refused at start-up with one
line naming what it uses. mlx-lm's ``make_cache`` says what each layer needs,
whatever the family, so that is what is checked.

Rows of a batch attend under one mask of shape ``(rows, 1, queries, keys)``,
as mlx-lm's own batch caches make it. A module whose attention does not
broadcast that mask over its heads (:data:`BATCH_MASK_MISREAD`) would let
batched requests attend through each other's masks: it is refused too.

A ``sliding_window`` that ``config.json`` states but mlx-lm's module for the
family does not apply (phi3, and mistral without ``layer_types``, in the
mlx-lm this runs on) leaves mlx-lm's own answers full attention: the pool
serves them as mlx-lm does, and the start-up log says past how many tokens
they may differ from the reference implementation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("veloxquant.server")


class ModelSourceError(RuntimeError):
    """``--model`` cannot be served: the message names the source and the fix."""


# mlx-lm modules whose attention misreads a batch's per-row mask, and how. gemma2's
# grouped-query attention scores (rows, kv heads, repeats, queries, keys), so a
# (rows, 1, queries, keys) mask lines its rows up with the KV heads.
BATCH_MASK_MISREAD = {
    "mlx_lm.models.gemma2": "grouped-query attention that lines a batch's per-row masks up "
                            "with its KV heads (batched requests would attend through each "
                            "other's masks)",
}


class UnsupportedModelError(ModelSourceError):
    """The model needs what the KV pool does not serve (the message names it)."""


def unserved_feature(model: Any) -> str | None:
    """What in ``model``'s layers the KV pool cannot hold, in words; None when it holds all.

    Args:
        model: An mlx-lm model.
    """
    misread = BATCH_MASK_MISREAD.get(type(model).__module__)
    if misread is not None:
        return misread
    make_cache = getattr(model, "make_cache", None)
    if not callable(make_cache):  # mlx-lm then gives every layer a plain KVCache
        return None
    from mlx_lm.models.cache import KVCache

    caches = make_cache()
    n_layers = len(model.layers)
    # Exactly KVCache: a subclass keeps (or drops) positions its own way.
    other = next((type(c) for c in caches if type(c) is not KVCache), None)
    if other is not None:
        return _describe(other, [c for c in caches if type(c) is other], n_layers)
    if len(caches) != n_layers:
        return f"{len(caches)} KV caches for its {n_layers} layers (layers share or skip KV)"
    return None


def _describe(kind: type, caches: list[Any], n_layers: int) -> str:
    """One cache class ``kind`` that ``caches`` of the model's layers are, in words."""
    from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, RotatingKVCache

    where = f"in {len(caches)} of {n_layers} layers"
    if issubclass(kind, RotatingKVCache):
        sizes = "/".join(str(s) for s in sorted({c.max_size for c in caches}))
        return f"sliding-window attention (window {sizes} {where})"
    if issubclass(kind, ChunkedKVCache):
        sizes = "/".join(str(s) for s in sorted({c.chunk_size for c in caches}))
        return f"chunked attention (chunks of {sizes} {where})"
    if issubclass(kind, ArraysCache):
        return f"a recurrent state instead of a KV cache {where}"
    return f"a {kind.__name__} cache {where}"


def refuse_unserved(model: Any, model_type: str) -> None:
    """Stop the load of a model the KV pool would serve wrong.

    Raises:
        UnsupportedModelError: One line: the model type and what it uses.
    """
    feature = unserved_feature(model)
    if feature is not None:
        raise UnsupportedModelError(
            f"model type {model_type} uses {feature}, which the KV pool does not serve "
            "yet; see docs/model_families.md for the families it serves")


def unapplied_window(config: dict) -> int | None:
    """The sliding window ``config`` states, where mlx-lm does not apply it; else None.

    Call after :func:`refuse_unserved`: a window mlx-lm applies is refused there.
    """
    window = config.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return None
    if config.get("use_sliding_window") is False:  # qwen2's switch: the window is off
        return None
    return window


def check_served(model: Any, path: Path, context: int | None) -> None:
    """Refuse a model the pool would serve wrong; warn of a stated window mlx-lm ignores.

    Args:
        model: The loaded mlx-lm model.
        path: Its folder (``config.json`` says what the model states).
        context: The context the model states, if any.

    Raises:
        UnsupportedModelError: See :func:`refuse_unserved`.
    """
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    model_type = str(config.get("model_type", type(model).__module__.rsplit(".", 1)[-1]))
    refuse_unserved(model, model_type)
    window = unapplied_window(config)
    if window is not None and (context is None or window < context):
        log.warning("model type %s states a sliding window of %d tokens that mlx-lm does not "
                    "apply: every layer attends to the whole context, as in mlx-lm, so past "
                    "%d tokens answers may differ from the reference implementation's "
                    "(limits.max_context_tokens=%d keeps within it)",
                    model_type, window, window, window)
