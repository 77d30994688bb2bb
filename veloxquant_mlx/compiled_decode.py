"""Decode calls of mlx-lm's Llama-shaped blocks through two compiled halves.

Why: once the model is small next to the machine, a decode step is mostly
the host building its graph, op by op, through Python modules (on an H200 a
1B bfloat16 model's step spent 1.6 ms building the graph, where reading its
2 GB of weights takes the GPU ~0.5 ms). A block's call is cut where the KV
cache comes in, and each side becomes one ``mx.compile`` call::

    pre   (x, position)   rms_norm, q/k/v projections, heads, RoPE,       compiled
                          keys and values stacked
          cache.update_and_fetch_stacked(...), the module's attention     as before
    post  (x, attention)  o_proj, residual, rms_norm, MLP, residual       compiled

A compiled call replays its recorded graph in C++ instead of running ~25
Python-level module calls, and fuses the elementwise ops (fewer kernels on a
GPU). With ``fuse_projections`` the halves also run q/k/v as one matmul and
the MLP's gate/up as another (:mod:`~veloxquant_mlx.fused_projections`).
Blocks with the same parameter shapes and settings share one compiled
pair, their weights passed in as inputs: a batch size seen for the first
time costs two traces (a few ms here), not two per layer. ``position`` is the
rows' offsets, or on the CPU the step's RoPE tables, computed once for every
layer (:mod:`~veloxquant_mlx.shared_rope`).

Only one-column calls on a :class:`~veloxquant_mlx.memory.paged_batch.PagedLayerCache`
(the server's decode steps) take this path; prompts, other caches and
un-batched generation run the block exactly as mlx-lm wrote it. The halves
compute the same ops in the same order, so the logits are bit for bit those
of the uncompiled block (tests/test_compiled_decode.py).
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from veloxquant_mlx.fused_projections import (
    MEMBERS,
    FusedProjection,
    fuse_block,
    plain_settings,
)
from veloxquant_mlx.memory.paged_layer_cache import PagedLayerCache
from veloxquant_mlx.shared_rope import shared_rope

# mlx-lm model modules whose block and attention calls are the Llama ones
# (``mistral`` checkpoints load as ``llama``), and whether their attention
# normalises each head's queries and keys (``q_norm``/``k_norm``) before RoPE.
LLAMA_SHAPED = {"mlx_lm.models.llama": False, "mlx_lm.models.qwen2": False,
                "mlx_lm.models.qwen3": True}
_FUSED = "_fused"  # the decode tree's key for the fused projections' parameters


class _Given:
    """Stands in for a projection whose output a fused matmul already computed."""

    def __init__(self, out: mx.array) -> None:
        self.out = out

    def __call__(self, x: mx.array) -> mx.array:
        return self.out


def _decode_tree(block: Any) -> dict:
    """The parameters a decode call reads: the block's, fused members by their fused layer."""
    tree = block.parameters()
    for child, fused in block._decode_fused.items():
        for name in MEMBERS[child]:
            del tree[child][name]  # views of the fused layer's parameters
        tree.setdefault(_FUSED, {})[child] = fused.module.parameters()
    return tree


class _Halves:
    """One compiled pre/post pair, for every block with ``template``'s signature.

    The traced functions run ``template``'s own module code with the
    parameters handed in swapped in (and put back after), so a trace records
    the block's ops with its weights as inputs.
    """

    def __init__(self, template: Any) -> None:
        self.template = template
        self.names = [name for name, _ in tree_flatten(_decode_tree(template))]
        self.fused: dict[str, FusedProjection] = template._decode_fused
        self.attention_module = sys.modules[type(template.self_attn).__module__]
        self.head_norms = LLAMA_SHAPED[self.attention_module.__name__]
        # RoPE's tables once per step where mx.fast.rope is plain ops (the CPU): see shared_rope.
        self.rope = shared_rope(template.self_attn.rope)
        self.pre = mx.compile(self._pre)
        self.post = mx.compile(self._post)

    def _swap_in(self, weights: tuple[mx.array, ...]) -> tuple[dict, dict]:
        """Put ``weights`` into the template (and its fused projections); returns its own."""
        own = self.template.parameters()
        own_fused = {c: p.module.parameters() for c, p in self.fused.items()}
        tree = tree_unflatten(list(zip(self.names, weights, strict=True)))
        for child, params in tree.pop(_FUSED, {}).items():
            self.fused[child].module.update(params)
        self.template.update(tree)
        return own, own_fused

    def _put_back(self, own: tuple[dict, dict]) -> None:
        self.template.update(own[0])
        for child, params in own[1].items():
            self.fused[child].module.update(params)

    def _rotate(self, t: mx.array, position: Any) -> mx.array:
        if self.rope is None:  # position: the rows' offsets
            return self.template.self_attn.rope(t, offset=position)
        return self.rope.rotate(t, *position)  # position: the step's (cos, sin)

    def _pre(self, x: mx.array, position: Any, *weights: mx.array):
        own = self._swap_in(weights)
        try:
            block = self.template
            attn = block.self_attn
            b, n, _ = x.shape
            # Rows flat (2-D): a 3-D matmul adds a flatten and an unflatten node each.
            h = block.input_layernorm(x.reshape(b * n, -1))
            qkv = self.fused.get("self_attn")
            q, k, v = qkv(h) if qkv else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
            q, k = q.reshape(b, n, attn.n_heads, -1), k.reshape(b, n, attn.n_kv_heads, -1)
            if self.head_norms:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
            v = v.reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            # Keys and values stacked (keys' rows, then values'), as the paged cache keeps them.
            return (self._rotate(q, position),
                    mx.concatenate([self._rotate(k, position), v]))
        finally:
            self._put_back(own)

    def _post(self, x: mx.array, attended: mx.array, *weights: mx.array) -> mx.array:
        own = self._swap_in(weights)
        try:
            block = self.template
            b, _, n, _ = attended.shape
            flat = attended.transpose(0, 2, 1, 3).reshape(b * n, -1)
            h = x.reshape(b * n, -1) + block.self_attn.o_proj(flat)
            return (h + self._mlp(block.post_attention_layernorm(h))).reshape(b, n, -1)
        finally:
            self._put_back(own)

    def _mlp(self, x: mx.array) -> mx.array:
        """The block's MLP on ``x``, its gate and up projections by one matmul if fused."""
        mlp, fused = self.template.mlp, self.fused.get("mlp")
        if fused is None:
            return mlp(x)
        # mlx-lm's own MLP code runs (its activation), handed the fused outputs: the
        # stand-ins shadow its children for this trace only.
        given = dict(zip(MEMBERS["mlp"], fused(x), strict=True))
        for name, out in given.items():
            object.__setattr__(mlp, name, _Given(out))
        try:
            return mlp(x)
        finally:
            for name in given:
                del mlp.__dict__[name]

    def __call__(self, block: Any, x: mx.array, mask: Any, cache: PagedLayerCache) -> mx.array:
        weights = block._decode_weights
        position = (cache.offset if self.rope is None
                    else self.rope.tables(cache.offset, x.shape[1]))
        q, new = self.pre(x, position, *weights)
        k, v = cache.update_and_fetch_stacked(new)
        # Looked up at each call: paged_attention.install may route it later.
        attend = self.attention_module.scaled_dot_product_attention
        out = attend(q, k, v, cache=cache, scale=block.self_attn.scale, mask=mask)
        return self.post(x, out, *weights)


_CLASSES: dict[type, type] = {}


def _compiled_class(base: type) -> type:
    """``base`` with decode calls on a paged cache routed through the block's halves."""
    if base not in _CLASSES:
        def __call__(self, x, mask=None, cache=None):
            if x.shape[1] != 1 or not isinstance(cache, PagedLayerCache):
                return base.__call__(self, x, mask, cache)
            return self._decode_halves(self, x, mask, cache)

        _CLASSES[base] = type(f"CompiledDecode{base.__name__}", (base,),
                              {"__call__": __call__, "__module__": base.__module__})
    return _CLASSES[base]


def _uncompiled_class(block: Any) -> type:
    cls = type(block)
    return cls.__mro__[1] if cls in _CLASSES.values() else cls


def _llama_shaped(block: Any) -> bool:
    base = _uncompiled_class(block)
    module = sys.modules.get(base.__module__)
    return (base.__module__ in LLAMA_SHAPED and base is getattr(module, "TransformerBlock", None)
            and type(getattr(block, "self_attn", None)) is getattr(module, "Attention", None))


def _signature(block: Any) -> tuple:
    """What a shared trace depends on: parameter shapes and every plain setting."""
    shapes = tuple((name, tuple(w.shape), w.dtype) for name, w in
                   tree_flatten(block.parameters()))
    settings = tuple((path, type(m).__name__, plain_settings(m))
                     for path, m in block.named_modules())
    return shapes, settings


def compile_decode_blocks(model: Any, fuse_projections: bool = True) -> int:
    """Route ``model``'s decode calls on paged caches through compiled halves.

    Call it once the weights are final (after loading, dequantizing,
    sharding): each block keeps the arrays it had then. Calling it again
    takes the current weights.

    Args:
        model: An mlx-lm model.
        fuse_projections: Run q/k/v and gate/up as one matmul each
            (:mod:`~veloxquant_mlx.fused_projections`; the projections'
            weights become views of one buffer per group). Off where something
            keys on those weights' own buffers (the CPU's quantized copies).

    Returns:
        Blocks now compiled (0 for a model whose blocks are not Llama-shaped:
        those keep running as mlx-lm wrote them).
    """
    blocks = [b for b in getattr(model, "layers", []) if _llama_shaped(b)]
    shared: dict[tuple, _Halves] = {}
    for block in blocks:
        # Plain attributes (not module children): the parameter tree stays mlx-lm's.
        object.__setattr__(block, "_decode_fused", fuse_block(block) if fuse_projections else {})
        key = (_signature(block), tuple(sorted(block._decode_fused)))
        halves = shared.get(key) or shared.setdefault(key, _Halves(block))
        object.__setattr__(block, "_decode_halves", halves)
        object.__setattr__(block, "_decode_weights",
                           tuple(w for _, w in tree_flatten(_decode_tree(block))))
        block.__class__ = _compiled_class(_uncompiled_class(block))
    return len(blocks)
